"""Start-up measurements kept across restarts: which native kernels and which weight layout won here.

A runner times each native kernel against torch's path (``layers/kernel_choice.py``) and, on a decode
engine, the linear weights' layouts (``layers/weight_format.py``), on its own model at load. Close
contests can go either way from one start to the next (a few percent apart, on a machine whose other
processes are starting too), and each outcome is a different compiled decode step, so a restart that
chose differently compiled from scratch instead of reusing inductor's cache (44 s against 9 s for the
built-in model on a 2-core AVX2 EPYC). So the first start's outcome is kept in
``~/.cache/pdserve/measured/<key>.json`` and later starts of the same model on the same machine take
it: the same plan every restart, the same compiled graphs, and no probe time.

The key hashes what the measurements depend on: the model (``config.json``, the weights' path and
modification times, the dtype and quantization), the machine (``pdserve.kernels.machine_key``: CPU,
kernel ISA and sources, torch's version), the torch thread count, the flags that steer the probes
and the probes' rules (``PROBE_RULES``).
``$PDSERVE_MEASURED_CHOICES`` names another directory, or ``off`` to measure at every start (the tests'
default); deleting a file measures again. An unreadable file is measured over.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib

import torch

from pdserve.engine.layers.kernel_choice import KernelChoice, apply_kernel_choices

logger = logging.getLogger(__name__)

CACHE_ENV = "PDSERVE_MEASURED_CHOICES"
VERSION = 1  # of the file's layout
# The probes' rules (what they time, how they decide): a change of rule measures again instead of keeping
# a choice the old rule made. 2: a packed weight layout must beat plain by weight_format.PROBE_MARGIN.
# 3: panels are timed in a huge-page arena, as they are then kept (weight_format.panel_arena).
# 4: a prefill worker times its layouts too, at prompt rows (weight_format.PREFILL_PROBE_ROWS).
PROBE_RULES = 4


def cache_dir() -> pathlib.Path | None:
    """Where measured choices are kept: ``$PDSERVE_MEASURED_CHOICES``, else ``~/.cache/pdserve/measured``;
    None when that variable is ``off``."""
    value = os.environ.get(CACHE_ENV, "")
    if value.lower() == "off":
        return None
    return pathlib.Path(value) if value else pathlib.Path.home() / ".cache" / "pdserve" / "measured"


def model_key(model_dir: str) -> str:
    """``config.json``'s text and each weight file's name, size and modification time, hashed."""
    root = pathlib.Path(model_dir)
    h = hashlib.sha256(str(root.resolve()).encode())
    for path in sorted(root.iterdir()):
        if path.name == "config.json":
            h.update(path.read_bytes())
        elif path.suffix in (".safetensors", ".bin", ".pt"):
            st = path.stat()
            h.update(f"{path.name}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def choices_path(model_dir: str, steering: dict) -> pathlib.Path | None:
    """The file for this model on this machine with these probe settings (``steering``: dtype,
    quantization, flags), or None where measured choices are not kept."""
    root = cache_dir()
    if root is None:
        return None
    from pdserve.kernels import machine_key

    parts = {"model": model_key(model_dir), "machine": machine_key(), "threads": torch.get_num_threads(),
             "probe_rules": PROBE_RULES, **steering}
    return root / (hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24] + ".json")


def load(path: pathlib.Path | None) -> tuple[dict[str, KernelChoice], tuple[str, str] | None] | None:
    """The kernel choices and the (layout, why) kept at ``path``, or None (none kept, or unreadable)."""
    if path is None or not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("version") != VERSION:
            return None
        kernels = {name: KernelChoice(**fields) for name, fields in data["kernels"].items()}
        layout = tuple(data["linear_weight_format"]) if data.get("linear_weight_format") else None
    except (OSError, ValueError, TypeError, KeyError) as e:
        logger.warning("measured choices at %s unreadable (%s); measuring again", path, e)
        return None
    return kernels, layout


def save(path: pathlib.Path | None, kernels: dict[str, KernelChoice], layout: tuple[str, str] | None) -> None:
    """Keep the choices at ``path`` (atomically: a file written aside, then renamed). Errors are logged:
    a start-up never fails for want of a cache."""
    if path is None:
        return
    data = {"version": VERSION, "kernels": {k: dataclasses.asdict(c) for k, c in kernels.items()},
            "linear_weight_format": list(layout) if layout else None}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("could not keep the measured choices at %s (%s)", path, e)


def restore(path: pathlib.Path | None) -> tuple[dict[str, KernelChoice], tuple[str, str] | None] | None:
    """``load``, and make the kept kernel choices this process's (``apply_kernel_choices``)."""
    kept = load(path)
    if kept is not None:
        apply_kernel_choices(kept[0])
    return kept
