"""The router's LoRA adapters: each is a model name clients may ask for.

With ``--enable-lora`` the router serves the base model under its served name and every
adapter under its own: ``--lora-modules name=PATH ...`` at start, ``POST
/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` while serving (vLLM's endpoints
and bodies; behind the API key like every ``/v1`` route). A request whose ``model`` is an
adapter's name carries that adapter's ``LoRARequest`` to both of its workers, which read
the adapter from ``lora_path`` themselves (a path every worker can read: a shared volume).

An adapter is read and checked against the base model here before it is listed, so a
bad one is a 400 at load time, not a failure in a worker's step. Each load gets a new
``lora_int_id``: a reloaded adapter never shares a worker's slot or prefix cache with the
one it replaced.
"""

from __future__ import annotations

import itertools
import logging

from transformers import AutoConfig

from pdserve.common.protocol import LoRARequest
from pdserve.engine.lora.adapter import LoRAAdapterError, load_adapter
from pdserve.router.errors import APIError, bad_request, model_not_found
from pdserve.router.openai_protocol import ModelCard

logger = logging.getLogger(__name__)


class LoRARegistry:
    """The adapters the router serves, by name.

    Args:
        base_model_dir: the base checkpoint (its config.json checks adapters' shapes).
        base_name: the base model's served name (an adapter may not take it).
        max_lora_rank: the workers' ``--max-lora-rank``: larger adapters are refused here.
    """

    def __init__(self, base_model_dir: str, base_name: str, max_lora_rank: int):
        self.base_model_dir = base_model_dir
        self.base_name = base_name
        self.max_lora_rank = max_lora_rank
        self._hf_config = AutoConfig.from_pretrained(base_model_dir)
        self._ids = itertools.count(1)
        self._adapters: dict[str, LoRARequest] = {}

    def __len__(self) -> int:
        return len(self._adapters)

    def load(self, name: str, path: str) -> LoRARequest:
        """Check the adapter at ``path`` and serve it as ``name``.

        Raises:
            APIError: 400 when the name is taken (by the base model or a loaded adapter) or the
                adapter cannot serve the base model (the reason in the message).
        """
        if name == self.base_name:
            raise bad_request(f"`{name}` is the base model's name; choose another name for the adapter", "lora_name")
        if name in self._adapters:
            raise bad_request(f"The LoRA adapter `{name}` has already been loaded; unload it first", "lora_name")
        try:
            adapter = load_adapter(name, path, self._hf_config, self.max_lora_rank)
        except LoRAAdapterError as e:
            raise bad_request(str(e), "lora_path") from e
        lora = LoRARequest(lora_name=name, lora_int_id=next(self._ids), lora_path=path)
        self._adapters[name] = lora
        logger.info("LoRA adapter %r (id %d, rank %d) loaded from %s", name, lora.lora_int_id, adapter.rank, path)
        return lora

    def unload(self, name: str) -> None:
        """Stop serving adapter ``name`` (requests already running finish with it).

        Raises:
            APIError: 404 when no adapter has that name.
        """
        if self._adapters.pop(name, None) is None:
            raise APIError(404, f"The LoRA adapter `{name}` cannot be found", "lora_name")
        logger.info("LoRA adapter %r unloaded", name)

    def resolve(self, model: str) -> LoRARequest | None:
        """The adapter a request's ``model`` names, or None for the base model.

        Raises:
            APIError: 404 for a name that is neither.
        """
        if model == self.base_name:
            return None
        lora = self._adapters.get(model)
        if lora is None:
            raise model_not_found(model)
        return lora

    def cards(self, max_model_len: int) -> list[ModelCard]:
        """One ``/v1/models`` entry per adapter (``root``: its path, ``parent``: the base model)."""
        return [ModelCard(id=lora.lora_name, root=lora.lora_path, parent=self.base_name, max_model_len=max_model_len)
                for lora in self._adapters.values()]
