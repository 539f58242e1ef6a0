"""Every message that crosses a process boundary, as msgspec Structs.

Messages travel over ZeroMQ as two frames: a one-byte kind (``MsgKind``) and
the msgpack payload. Each kind has its own typed decoder (see
``pdserve.common.transport``), so a payload is never interpreted as anything
but the struct its kind names. Python objects are never serialized as such.

Rules (vLLM v1 engine-core style):
  * ``array_like=True``: compact positional encoding (fields by position).
  * New fields go last, with defaults, so older peers still decode.
  * Every message about a request names the router's ``request_id``.
  * ``None`` means "absent"; never ``-1``.

Who sends what:

    worker  -> router : RegisterWorker, Heartbeat, RequestOutputs, WorkerDraining, WorkerExiting,
                        KVEventBatch (to every router of the tier; RequestOutputs to the request's
                        own router)
    router  -> decode : GenerateRequest, AbortRequest
    router  -> worker : DrainWorker, KVEventsReplay
    decode  -> prefill: RemotePrefillRequest, AbortRequest
    prefill -> decode : KVTransferHeader, RemotePrefillDone
"""

from __future__ import annotations

import enum

import msgspec


class MsgKind(enum.IntEnum):
    """The one-byte kind frame that precedes every payload."""

    REGISTER_WORKER = 1
    HEARTBEAT = 2
    GENERATE = 3
    ABORT = 4
    REMOTE_PREFILL = 5
    KV_TRANSFER_HEADER = 6
    REMOTE_PREFILL_DONE = 7
    REQUEST_OUTPUTS = 8
    RANK_REPORT = 9
    DRAIN_WORKER = 10
    WORKER_DRAINING = 11
    WORKER_EXITING = 12
    WARM_KV_PAIR = 13
    CONNECT_KV_PAIR = 14
    KV_EVENTS = 15
    KV_EVENTS_REPLAY = 16


class WorkerRole(enum.IntEnum):
    PREFILL = 1
    DECODE = 2


class FinishReason(enum.IntEnum):
    """Why a request stopped; rendered as OpenAI's ``finish_reason`` strings."""

    STOP = 1  # EOS token, stop token id, or stop string
    LENGTH = 2  # max_tokens or max_model_len reached
    ABORT = 3  # client went away / router aborted
    ERROR = 4  # the worker failed the request (see ``error``)

    def to_openai(self) -> str:
        return {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}.get(self, "abort")


class ErrorKind(enum.IntEnum):
    """Why a worker failed a request; the router answers with ``http_status``."""

    INVALID_REQUEST = 1  # the request breaks a rule of this worker (length, vocabulary, sampling range)
    UNAVAILABLE = 2  # the worker cannot serve it now (shutting down, a peer failed under policy ``fail``)
    INTERNAL = 3  # a bug or a failed forward pass

    @property
    def http_status(self) -> int:
        return {ErrorKind.INVALID_REQUEST: 400, ErrorKind.UNAVAILABLE: 503}.get(self, 500)


class _Msg(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    pass


class StructuredOutputsParams(_Msg):
    """What the output must match (vLLM's ``structured_outputs``); exactly one field is set.

    ``json`` is a JSON schema serialized as text; ``json_object`` any JSON object;
    ``regex`` a regular expression; ``choice`` one of these strings; ``grammar`` a
    Lark-style context-free grammar. ``disable_any_whitespace`` makes JSON compact
    (by default any JSON whitespace may appear between tokens, as in vLLM).
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False  # JSON: no whitespace between tokens (vLLM's option)


class SamplingParams(_Msg):
    """How to pick tokens. ``temperature == 0`` means greedy.

    ``top_k`` None disables top-k; ``seed`` None uses the worker's generator.
    ``stop`` strings are matched by the router on detokenized text; the
    workers stop on ``stop_token_ids`` and the model's EOS ids.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1  # parallel samples (choices) of one prompt; they share the prompt's KV blocks
    logprobs: int | None = None  # return the sampled token's logprob and this many top alternatives
    frequency_penalty: float = 0.0  # OpenAI: logit -= frequency_penalty * count(token in output)
    presence_penalty: float = 0.0  # OpenAI: logit -= presence_penalty * (token in output)
    # --- issue 12 (vLLM's names) ---
    repetition_penalty: float = 1.0  # CTRL (Keskar et al. 2019): over prompt + output, >1 discourages repeats
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI's logit_bias)
    bad_words_token_ids: list[list[int]] = []  # token sequences never generated (the router tokenizes bad_words)
    prompt_logprobs: int | None = None  # logprobs of each prompt token and this many top alternatives
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output to a grammar
    priority: int = 0  # scheduling priority under --scheduling-policy priority: lower runs sooner


class LoRARequest(_Msg):
    """Which LoRA adapter serves a request (vLLM's ``LoRARequest``).

    ``lora_name``: the model name clients use; ``lora_int_id``: unique per load (>= 1), so a
    reloaded adapter under the same name never reuses the old one's weights or KV;
    ``lora_path``: a PEFT adapter directory (``adapter_config.json`` +
    ``adapter_model.safetensors``) every worker can read. See ``pdserve.engine.lora``.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str


class TokenLogprob(_Msg):
    """Log-probabilities at one output position, from the model's raw distribution
    (log-softmax of the logits before temperature, penalties, top-k/top-p)."""

    token_id: int
    logprob: float
    top_token_ids: list[int] = []
    top_logprobs: list[float] = []
    rank: int | None = None  # prompt logprobs: 1 + how many ids the model ranks above token_id (vLLM's rank)


class WorkerStats(_Msg):
    """Cumulative counters a worker reports in every heartbeat (since it started)."""

    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens whose KV was already cached
    num_prompt_tokens: int = 0  # prompt tokens of requests admitted
    num_generation_tokens: int = 0  # tokens sampled
    num_kv_transfers: int = 0  # requests whose KV was sent (prefill) / received (decode)
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    kv_transfer_failures: int = 0
    num_local_prefills: int = 0  # decode worker: prompts its scheduler kept from a remote prefill (not the router's)
    spec_decode_num_drafts: int = 0  # speculative decoding: verifications with at least one draft
    spec_decode_num_draft_tokens: int = 0  # draft tokens proposed
    spec_decode_num_accepted_tokens: int = 0  # of those, accepted by the target
    prefill_compute_tokens: int = 0  # prompt tokens computed here (prefix-cache hits and received KV excluded)
    prefill_compute_seconds: float = 0.0  # wall time of the steps that computed them
    num_decode_steps: int = 0  # decode worker: steps whose every row was past its prompt (decode only)
    decode_step_seconds: float = 0.0  # their forward + sampling time, summed (mean step = this / num_decode_steps)
    kv_transfer_bytes_from_cache: int = 0  # prefill worker: of kv_transfer_bytes, those sent from the cache itself
    kv_offload_blocks: int = 0  # blocks copied from the KV cache to the offload tier (--kv-offload-memory)
    kv_onload_blocks: int = 0  # blocks copied back from it: prefix hits in the tier, in blocks
    kv_offload_copy_seconds: float = 0.0  # wall time of those copies (both ways)
    kv_disk_write_blocks: int = 0  # blocks the host tier evicted, written to the disk tier (--kv-offload-disk)
    kv_disk_read_blocks: int = 0  # blocks read back from it: prefix hits there
    # Per tier (host: --kv-offload-memory, disk: --kv-offload-disk), as measured on the driver rank:
    kv_block_bytes: int = 0  # one block of the KV cache over every rank (the unit of the tiers' copies)
    kv_offload_seconds: float = 0.0  # wall time of the copies into the host tier
    kv_onload_seconds: float = 0.0  # ... back from it
    kv_disk_write_seconds: float = 0.0  # ... into the disk tier
    kv_disk_read_seconds: float = 0.0  # ... back from it
    kv_host_recomputed_hits: int = 0  # hits in the host tier recomputed instead: loading measured slower
    kv_disk_recomputed_hits: int = 0  # ... in the disk tier
    kv_host_saved_seconds: float = 0.0  # recompute time the host tier's hits saved (measured speeds)
    kv_disk_saved_seconds: float = 0.0  # ... the disk tier's
    num_borrowed_steps: int = 0  # decode worker: steps run on an idle prefill worker's cores too (core lending)


class KVLayout(_Msg):
    """How a worker's KV cache is split over its ranks (see ``pdserve.common.sharding``)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    num_layers: int = 0  # the model's, in total
    num_kv_heads: int = 0  # the model's, in total
    # The KV cache dtype name (float32, bfloat16, float16, int8, fp8_e4m3, fp8_e5m2; see common.kv_quant);
    # a prefill and a decode worker pair only when theirs are equal. None: not said (an older worker).
    kv_cache_dtype: str | None = None
    # The weights' quantization ("none", "int8", "compressed-tensors"): KV built by a differently
    # quantized model differs, so a pair needs equal ones too. None: not said (an older worker).
    quantization: str | None = None


class RegisterWorker(_Msg):
    """Worker -> router at start-up (and again if the router forgets it)."""

    worker_id: str
    role: WorkerRole
    input_addr: str  # ZMQ address the worker's PULL socket is bound to
    model_name: str
    transfer_host: str | None = None  # decode workers: TCPStore for KV pairing
    transfer_port: int | None = None
    num_blocks: int = 0
    block_size: int = 0
    kv_group_caps: list[int | None] | None = None  # per KV cache group, a window's cap on one sequence's blocks
    # (EngineLimits); None: one group that keeps every block
    max_model_len: int = 0
    vocab_size: int | None = None  # token ids the model accepts: [0, vocab_size)
    kv_layout: KVLayout | None = None  # None: one rank holding every layer and KV head
    auth: str | None = None  # with a cluster secret: pdserve.common.auth.registration_token
    # The router address this copy was pushed to (a worker registers with every router of a tier):
    # the router names it in each GenerateRequest, so the worker knows where that request's outputs go.
    router_addr: str | None = None
    # What computes on this worker, as measured at load (pdserve.engine.layers.kernel_choice): per native kernel
    # that has a torch path, "native" or "torch"; and the linear weights' layout (plain, onednn, panel).
    kernels: dict[str, str] = {}
    linear_weight_format: str | None = None
    # Every start-up choice of the worker's model runner, "value (why)" per decision
    # (pdserve.engine.execution.runner_plan): shown in /workers.
    plan: dict[str, str] = {}
    # The salt of its prefix cache's block hashes (``pdserve.engine.scheduling.block_manager.chain_hash``):
    # with it the router hashes a prompt's blocks as this worker does and matches them against its KV
    # events. None: prefix caching is off here (it publishes no events).
    prefix_cache_salt: int | None = None
    kv_offload_blocks: int = 0  # blocks of its offload tiers (--kv-offload-memory, --kv-offload-disk), beyond num_blocks


class Heartbeat(_Msg):
    """Worker -> router every heartbeat interval, with load figures."""

    worker_id: str
    role: WorkerRole
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    max_step_batch_size: int = 0  # largest number of sequences in one step so far
    num_steps: int = 0
    stats: WorkerStats = msgspec.field(default_factory=WorkerStats)
    # Seconds since the step loop last finished an iteration. Heartbeats come from an IO
    # thread, so a long step never silences them; this says whether the loop is progressing.
    loop_stall_s: float = 0.0
    draining: bool = False  # the worker is leaving: route nothing new to it
    max_lora: int = 0  # LoRA slots (--max-loras) with --enable-lora, else 0
    running_lora_adapters: list[str] = []  # adapters of the running requests (names)
    waiting_lora_adapters: list[str] = []  # adapters of the waiting requests
    # the decode step as it runs now: "compiled", "compiling" (built in the background: eager meanwhile) or
    # "eager"; "" from a worker that does not say
    decode_step: str = ""


class DrainWorker(_Msg):
    """Router -> worker: nothing more will be routed to you; finish what you hold, then exit.

    Sent once the router holds no request that still needs the worker (for a prefill worker: no
    request naming it is waiting for its KV), so the worker may leave as soon as it is idle.
    """

    reason: str = ""
    router_addr: str | None = None  # the sending router, as the worker reaches it (RegisterWorker.router_addr)


class WorkerDraining(_Msg):
    """Worker -> router: I was asked to stop (SIGTERM); route nothing new to me, send ``DrainWorker``."""

    worker_id: str
    role: WorkerRole
    input_addr: str
    auth: str | None = None  # with a cluster secret: the worker's registration token


class WorkerExiting(_Msg):
    """Worker -> router: I am exiting now; drop me from the pool (without waiting for a timeout)."""

    worker_id: str
    role: WorkerRole
    input_addr: str
    auth: str | None = None
    reason: str = ""


class ResumedChoice(_Msg):
    """One choice of a migrated request: the tokens it already produced on a worker that went away."""

    index: int
    output_token_ids: list[int] = []


class GenerateRequest(_Msg):
    """Router -> decode worker: start a request.

    ``prefill_worker_id``/``prefill_addr`` name the prefill worker that should
    build the prompt's KV, or are None for a local prefill on the decode worker.
    ``resume`` (a request migrated off a dead or stuck decode worker) lists the
    choices still unfinished, each continuing after the tokens it already
    produced: they are recomputed here as context but count as output (for
    ``max_tokens``, ``min_tokens``, penalties and the seeded draw of each
    position), so the continuation is what the first worker would have produced.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prefill_worker_id: str | None = None
    prefill_addr: str | None = None
    prefill_layout: KVLayout | None = None  # the prefill worker's ranks (None: one rank)
    resume: list[ResumedChoice] | None = None
    lora: LoRARequest | None = None  # the adapter applied on both workers (None: the base model)
    # Where the request's outputs go: the router that took it, as this worker reaches it (the
    # RegisterWorker.router_addr it registered with). None: the worker's first router.
    router_addr: str | None = None


class AbortRequest(_Msg):
    """Router -> decode, or decode -> prefill: drop the request, free its blocks."""

    request_id: str


class RemotePrefillRequest(_Msg):
    """Decode -> prefill: compute this prompt's KV and send it to me.

    The decode worker has already reserved ``len(dest_block_ids)`` blocks.
    ``transfer_host``/``transfer_port`` is the decode worker's TCPStore where
    the two-rank (prefill, decode) process group of generation
    ``pair_generation`` rendezvouses.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    decode_worker_id: str
    decode_addr: str
    transfer_host: str
    transfer_port: int
    pair_generation: int
    dest_block_ids: list[int]
    num_cached_tokens: int = 0  # the decode worker already holds these tokens' KV (prefix cache, whole blocks):
    # send only blocks from num_cached_tokens // block_size on
    first_block: int | None = None  # the first logical block to send, when later than the cache hits: a
    # sliding window's first live block (blocks before it are never read); None: num_cached_tokens // block_size
    # Per layer of the model (global index), the first logical block to send for that layer, when layers differ:
    # the decode worker's sliding-window layers keep only their window (KV cache groups); None: first_block.
    layer_first_blocks: list[int] | None = None
    decode_layout: KVLayout | None = None  # the decode worker's ranks (None: one rank)
    lora: LoRARequest | None = None  # the adapter the KV is built with (the decode worker's too)
    router_addr: str | None = None  # the router that took the request (GenerateRequest.router_addr)


class KVTransferHeader(_Msg):
    """Prefill -> decode, sent just before the KV tensors of one request.

    The tensors follow on the pair's process group, layer by layer, each layer of shape
    ``[kv_slots, num_blocks, block_size, num_kv_heads, head_dim]`` in the messages of
    ``wire.layer_runs`` (each slot's blocks in runs of at most 512 KiB on a CPU pair), and dtype ``dtype``: the KV cache dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``,
    or a quantized ``"int8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``, whose tensors are uint8 with a last
    axis of ``head_dim + 4`` bytes: the quantized row, then its float32 scale). ``head_dim`` is
    always the model's (``pdserve.kvtransfer.wire``). ``kv_slots``: 2 (K and V) or 1 (a latent
    cache, MLA: one row per token whose first kv_lora_rank values are its value).
    """

    request_id: str
    prefill_worker_id: str
    pair_generation: int
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    num_tokens: int
    first_block: int = 0  # index in the request's block table of the first block sent
    # Per layer of this piece, the blocks it carries when layers differ (a sliding-window layer sends only its
    # window's: its logical blocks [num_tokens' blocks - n, num_tokens' blocks)); [] = num_blocks each.
    # num_blocks is then the largest.
    layer_num_blocks: list[int] = []
    # Which piece this is (``sharding.transfer_pieces``): sent by prefill rank ``prefill_rank`` to decode
    # rank ``decode_rank``, holding global layers [first_layer, first_layer + num_layers) and KV heads
    # [first_kv_head, first_kv_head + num_kv_heads). One header per piece; single-rank workers: one piece.
    prefill_rank: int = 0
    decode_rank: int = 0
    first_layer: int = 0
    first_kv_head: int = 0
    kv_slots: int = 2  # rows per token and KV head in each layer tensor: 2 (K, V) or 1 (a latent)


class KVPieceSum(_Msg):
    """Bytes and checksum of one transfer piece, as its sender counted them."""

    prefill_rank: int
    decode_rank: int
    num_bytes: int
    checksum: int


class RequestTiming(_Msg):
    """When one request passed each point on its way to its first token, on the worker clocks.

    Wall-clock seconds (``time.time()``) of the process that took each one; None: not reached (or
    not on this request's path). The prefill worker fills the ``prefill_*`` fields and sends them
    in ``RemotePrefillDone``; the decode worker adds its own and sends them all in the request's
    first ``RequestDelta``, where the router turns them into hops (``pdserve.router.tracing``).
    Stamps from different hosts are only as comparable as their clocks are synchronized.
    """

    decode_received: float | None = None  # decode worker: GenerateRequest handled by its step loop
    remote_prefill_sent: float | None = None  # decode worker: blocks reserved, RemotePrefillRequest sent
    prefill_received: float | None = None  # prefill worker: RemotePrefillRequest handled by its step loop
    # The worker that computes the prompt (prefill worker, or the decode worker for a local prefill):
    prefill_started: float | None = None  # the first step that computed prompt tokens started
    prefill_done: float | None = None  # the step that computed its last prompt token returned (first token sampled)
    kv_installed: float | None = None  # decode worker: every KV piece and the done message checked, install sent


class RemotePrefillDone(_Msg):
    """Prefill -> decode after the last layer was sent (or on failure).

    ``checksum`` covers every byte sent (see ``pdserve.kvtransfer.kv_checksum``);
    ``error`` is set, and the other fields meaningless, if the prefill failed.
    """

    request_id: str
    prefill_worker_id: str
    first_token_id: int | None = None  # None only with ``error`` set
    num_tokens: int = 0
    num_bytes: int = 0
    checksum: int = 0
    error: str | None = None
    first_logprob: TokenLogprob | None = None  # when sampling_params.logprobs is set
    pieces: list[KVPieceSum] = []  # per-piece bytes and checksums (multi-rank workers)
    # sampling_params.prompt_logprobs set: prompt tokens 1..N-1 given their prefixes (token 0 has none)
    prompt_logprobs: list[TokenLogprob] = []
    timing: RequestTiming | None = None  # the prefill worker's stamps (prefill_received/started/done)


class RequestDelta(_Msg):
    """New tokens of one request since the last delta."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    index: int = 0  # which of the request's n choices these tokens belong to
    logprobs: list[TokenLogprob] | None = None  # one per new token, when requested
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error_kind: ErrorKind | None = None  # with ``error``: what the router answers (400/503/500)
    # In the first delta of choice 0 when sampling_params.prompt_logprobs is set: prompt tokens
    # 1..N-1, each given its prefix (the first prompt token has none)
    prompt_logprobs: list[TokenLogprob] | None = None
    timing: RequestTiming | None = None  # in the request's first delta: its way to the first token


class RequestOutputs(_Msg):
    """Decode worker -> router: every delta produced by one step."""

    worker_id: str
    deltas: list[RequestDelta]


class RankReportKind(enum.IntEnum):
    PAIR_READY = 1  # prefill rank: the pair with ``peer`` (generation) is connected
    PAIR_FAILED = 2
    SENT = 3  # prefill rank: a piece of ``request_id`` was delivered (or failed: ``error``)
    RECEIVED = 4  # decode rank: a piece of ``request_id`` arrived whole (or failed: ``error``)


class RankReport(_Msg):
    """A non-driver rank -> its driver's mailbox (ZMQ): how its part of a KV transfer went."""

    rank: int
    kind: RankReportKind
    peer: str  # the other side's endpoint, "worker_id#rank"
    generation: int
    request_id: str | None = None
    num_bytes: int = 0
    checksum: int = 0
    error: str | None = None
    num_bytes_from_cache: int = 0  # SENT: of num_bytes, those sent straight from the cache (not gathered)


class RankAttach(_Msg):
    """Driver -> its ranks, once the worker is up: who they work for (KV transfer roles)."""

    worker_id: str
    role: WorkerRole
    driver_addr: str  # the driver's mailbox, where RankReports go
    host: str  # interface the rank's transfer pairs bind
    store_host: str | None = None  # decode: the driver's KV pair store
    store_port: int | None = None
    transfer_timeout_s: float = 30.0


class KVConnect(_Msg):
    """Prefill ranks: connect the pairs with these decode ranks (generation), through D's store."""

    decode_worker_id: str
    generation: int
    store_host: str
    store_port: int
    decode_layout: KVLayout | None = None  # None: one rank


class KVLane(_Msg):
    """Decode ranks: open a receiving lane for each prefill rank that sends to them."""

    prefill_worker_id: str
    generation: int
    prefill_layout: KVLayout | None = None  # None: one rank


class KVSendPlan(_Msg):
    """Prefill ranks: this step computes the prompt of ``request_id``: send its pieces layer by layer."""

    request_id: str
    seq_index: int  # its row in the step's block_tables
    first_block: int
    num_blocks: int  # every layer sends its logical blocks [its first, first_block + num_blocks)
    decode_worker_id: str
    generation: int
    decode_layout: KVLayout | None = None  # None: one rank
    layer_first_blocks: list[int] | None = None  # per global layer, its first block (RemotePrefillRequest's)


class KVInstall(_Msg):
    """Decode ranks: copy the received pieces of ``request_id`` into these blocks.

    ``block_ids``: KV cache group 0's (every layer's with one group); ``group_block_ids``: groups 1..
    (``pdserve.common.kv_cache_groups``). A layer's blocks are the last its piece carries of its group's."""

    request_id: str
    block_ids: list[int]
    group_block_ids: list[list[int]] = []


class KVReset(_Msg):
    """Every rank: drop the pairs with ``peer_worker_id`` at ``generation`` (a failed transfer).

    ``sending``: which pairs, on a decode worker that also sends (a peer pulls a prefix from it): True
    the ones it sends on, False the ones it receives on, None by the worker's role."""

    peer_worker_id: str
    generation: int
    reason: str
    sending: bool | None = None


class KVStepOps(_Msg):
    """The KV transfer work of one step, for every rank (each takes what names it)."""

    connects: list[KVConnect] = []
    lanes: list[KVLane] = []
    sends: list[KVSendPlan] = []
    headers: list[KVTransferHeader] = []
    installs: list[KVInstall] = []
    drops: list[str] = []  # request ids whose received pieces are no longer wanted
    resets: list[KVReset] = []


class WarmKVPair(_Msg):
    """Router -> decode worker: a prefill worker you may receive KV from has registered; set up the
    transfer pair with it now (``ConnectKVPair``), so no request waits for the connection."""

    prefill_worker_id: str
    prefill_addr: str
    prefill_layout: KVLayout | None = None


class ConnectKVPair(_Msg):
    """Decode -> prefill: connect your ranks' pairs with mine at ``pair_generation`` (my lanes are
    listening at the TCPStore ``transfer_host``/``transfer_port``), ahead of any request: what a
    ``RemotePrefillRequest`` does first, without the request."""

    decode_worker_id: str
    transfer_host: str
    transfer_port: int
    pair_generation: int
    decode_layout: KVLayout | None = None


class TierOpKind(enum.IntEnum):
    """What one offload tier copy moves (``TierOp``)."""

    SPILL = 1  # host slot ``src`` -> disk slot ``dst`` (the block ``key`` with ``tokens``)
    OFFLOAD = 2  # KV cache block ``src`` -> host slot ``dst``
    LOAD = 3  # disk slot ``src`` -> KV cache block ``dst`` (checked to be block ``key``)
    ONLOAD = 4  # host slot ``src`` -> KV cache block ``dst``


class TierOp(_Msg):
    """One copy between the KV cache and its offload tiers (``pdserve.engine.scheduling.kv_offload``)."""

    kind: TierOpKind
    src: int
    dst: int
    key: bytes = b""
    tokens: list[int] = []


class ExecuteModel(_Msg):
    """Driver rank -> the other ranks of its worker, once per step (over the worker's own
    torch.distributed gloo group as msgpack bytes, not ZMQ; see ``pdserve.engine.execution.parallel``).

    The flattened batch exactly as ``ModelRunner.prepare_inputs`` builds it: input_ids,
    positions, slot_mapping [num_tokens]; block_tables [num_seqs][max_num_blocks];
    seq_lens [num_seqs]; query_start_loc [num_seqs + 1]; sample_indices [num_sampled] (the rows
    to sample, then the rows of prompt positions whose logprobs were asked for, in that order).
    ``block_copies`` are copy-on-write (src, dst) block copies to do first. An empty step
    (no tokens, no copies) is a liveness ping; ``shutdown`` ends the ranks' loops.
    """

    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    block_tables: list[list[int]] = []
    # KV cache groups 1.. (pdserve.common.kv_cache_groups; slot_mapping and block_tables are group 0's): each
    # group's slot mapping [num_tokens] and block tables [num_seqs][its width]; [] = one group
    group_slot_mappings: list[list[int]] = []
    group_block_tables: list[list[list[int]]] = []
    seq_lens: list[int] = []
    rope_seq_lens: list[int] = []  # [num_seqs] each request's known length, for a length-dependent RoPE only; [] = none
    query_start_loc: list[int] = []
    max_query_len: int = 0
    max_seq_len: int = 0
    sample_indices: list[int] = []
    block_copies: list[tuple[int, int]] = []
    shutdown: bool = False
    kv: KVStepOps | None = None  # KV transfer work, before the forward
    attach: RankAttach | None = None
    lora_loads: list[tuple[int, LoRARequest]] = []  # (slot, adapter) to load into a LoRA slot first
    lora_slots: list[int] = []  # [num_seqs] each sequence's LoRA slot, -1 for the base model; [] = none
    # The offload tiers' copies (pdserve.engine.scheduling.kv_offload), before anything else of the step,
    # in this order: the order the tiers' indexes changed
    kv_tier_ops: list[TierOp] = []


# ---- KV events (vLLM's names and fields; pdserve.cluster.kv_events publishes, pdserve.router.kv_index reads) ----

KV_MEDIA = ("device", "host", "disk")  # the tiers a block may live in, fastest first


class BlockStored(_Msg, tag=True):
    """Full blocks entered a tier of the worker's prefix cache: a request can now reuse them.

    ``block_hashes``: their chained SHA-256 hashes (32 bytes each, ``chain_hash``), in prefix order;
    ``parent_block_hash``: the hash before the first (None: the first is a prompt's first block, or
    unknown, as in a snapshot); ``token_ids``: their tokens, ``block_size`` per block; ``lora_id``: the
    adapter (None: the base model; the hash already depends on it); ``medium``: the tier
    (``KV_MEDIA``); ``group``: the KV cache group (``pdserve.common.kv_cache_groups``)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str = "device"
    group: int = 0


class BlockRemoved(_Msg, tag=True):
    """Blocks left a tier (evicted or reset): a request can no longer reuse them from there."""

    block_hashes: list[bytes]
    medium: str = "device"
    group: int = 0


class AllBlocksCleared(_Msg, tag=True):
    """Every block of every tier is gone (a snapshot starts with it)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(_Msg):
    """Worker -> every router: the KV events of one step, in order (vLLM's ``KVEventBatch``).

    ``seq`` counts a worker process's batches from 0 with no gap (``instance`` names the process: a
    restarted worker starts again at 0); a router that sees a gap asks for the rest
    (``KVEventsReplay``). ``snapshot``: the events are ``AllBlocksCleared`` and then every block
    cached now, answering a replay older than the worker still holds; ``seq`` is then the last
    batch they include. ``ts``: ``time.time()`` when the batch was made."""

    worker_id: str
    instance: int
    seq: int
    ts: float
    events: list[KVEvent] = []
    snapshot: bool = False
    data_parallel_rank: int | None = None


class KVEventsReplay(_Msg):
    """Router -> worker: send me your KV event batches from ``from_seq`` on (a snapshot where they
    are no longer held). ``router_addr``: where to send them (the router as the worker reaches it)."""

    from_seq: int
    router_addr: str | None = None


MESSAGE_TYPES: dict[MsgKind, type[msgspec.Struct]] = {
    MsgKind.REGISTER_WORKER: RegisterWorker,
    MsgKind.HEARTBEAT: Heartbeat,
    MsgKind.GENERATE: GenerateRequest,
    MsgKind.ABORT: AbortRequest,
    MsgKind.REMOTE_PREFILL: RemotePrefillRequest,
    MsgKind.KV_TRANSFER_HEADER: KVTransferHeader,
    MsgKind.REMOTE_PREFILL_DONE: RemotePrefillDone,
    MsgKind.REQUEST_OUTPUTS: RequestOutputs,
    MsgKind.RANK_REPORT: RankReport,
    MsgKind.DRAIN_WORKER: DrainWorker,
    MsgKind.WORKER_DRAINING: WorkerDraining,
    MsgKind.WORKER_EXITING: WorkerExiting,
    MsgKind.WARM_KV_PAIR: WarmKVPair,
    MsgKind.CONNECT_KV_PAIR: ConnectKVPair,
    MsgKind.KV_EVENTS: KVEventBatch,
    MsgKind.KV_EVENTS_REPLAY: KVEventsReplay,
}
KIND_OF: dict[type[msgspec.Struct], MsgKind] = {t: k for k, t in MESSAGE_TYPES.items()}
