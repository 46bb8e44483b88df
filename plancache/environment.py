"""The GPU environment fingerprint a plan is valid for, and its detection on a CUDA device of this machine.

A plan is only valid on the same SM (compute capability), SM count, exact cuDNN backend
version, CUDA driver version and cuDNN frontend version: these are the *validity* fields.
Device name, CUDA runtime and torch version are kept for information only.

A device is named by its ordinal among the devices this process sees, which ``CUDA_VISIBLE_DEVICES`` may
renumber (with ``CUDA_VISIBLE_DEVICES=2,3`` ordinal 1 is the host's GPU 3); :func:`device_selector` gives the
value that makes one of them the only device of a child process.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
from collections.abc import Mapping
from typing import Annotated, Any

from annotated_types import Ge, Le
from pydantic import BeforeValidator, ConfigDict, Field, StringConstraints

from .canonical import canonical_json
from .errors import GpuUnavailable
from .validation import INT32_MAX, StrictModel, refuse_bool

#: The fields a plan's environment must match exactly; the info fields are for people to read.
VALIDITY_FIELDS: tuple[str, ...] = ("sm", "sm_count", "cudnn_version", "driver_version", "frontend_version")
INFO_FIELDS: tuple[str, ...] = ("device_name", "cuda_runtime", "torch_version")
#: An environment id: 32 lowercase hex characters.
ENV_ID_PATTERN = r"^[0-9a-f]{32}$"

#: The validity fields' types, bounds included (:class:`~plancache.protocol.TargetEnvironment` makes each optional).
Sm = Annotated[int, Ge(10), Le(1000), BeforeValidator(refuse_bool)]
SmCount = Annotated[int, Ge(1), Le(100_000), BeforeValidator(refuse_bool)]
Version = Annotated[int, Ge(1), Le(INT32_MAX), BeforeValidator(refuse_bool)]
#: A version as packages spell it (PEP 440, local part included): no spaces, quotes or control characters, which
#: would also make a target's canonical JSON (``jobs.target_key``) grow past its column.
FrontendVersion = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[0-9A-Za-z.+!_-]+$")]


class Environment(StrictModel):
    """A GPU environment. ``sm`` is major*10+minor (90 for an H100/H200)."""

    model_config = ConfigDict(frozen=True)

    sm: Sm = Field(description="compute capability, major*10+minor")
    sm_count: SmCount
    cudnn_version: Version = Field(description="cuDNN backend version, e.g. 91900")
    driver_version: Version = Field(description="CUDA driver API version, e.g. 13000")
    frontend_version: FrontendVersion = Field(description="nvidia-cudnn-frontend version")
    device_name: str = Field(default="", max_length=256)
    cuda_runtime: str = Field(default="", max_length=64)
    torch_version: str = Field(default="", max_length=64)

    def validity(self) -> dict[str, Any]:
        """The fields a plan must match exactly."""
        return {f: getattr(self, f) for f in VALIDITY_FIELDS}

    @property
    def env_id(self) -> str:
        """Stable id of the validity fields (32 hex chars)."""
        return environment_id(self.validity())

    def describe(self) -> str:
        name = self.device_name or "GPU"
        return (
            f"{name} sm_{self.sm} x{self.sm_count} SMs, cuDNN {self.cudnn_version}, "
            f"driver {self.driver_version}, frontend {self.frontend_version}"
        )


def environment_id(validity: dict[str, Any]) -> str:
    """The first 32 hex characters of the sha256 of the validity fields' canonical JSON."""
    return hashlib.sha256(canonical_json({f: validity[f] for f in VALIDITY_FIELDS}).encode()).hexdigest()[:32]


def cuda_driver_version() -> int:
    """The CUDA driver API version via ``cuDriverGetVersion`` in libcuda."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise GpuUnavailable(f"no CUDA driver library (libcuda.so.1): {exc}") from exc
    version = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
        raise GpuUnavailable("cuDriverGetVersion failed")
    return int(version.value)


#: An entry of ``CUDA_VISIBLE_DEVICES`` that CUDA accepts: an ordinal, or a (prefix of a) GPU or MIG UUID.
_VISIBLE_ENTRY = re.compile(r"^(?:\d+|GPU-[0-9A-Fa-f-]+|MIG-[0-9A-Za-z/-]+)$")


def visible_devices(environ: Mapping[str, str] = os.environ) -> list[str] | None:
    """The entries of ``CUDA_VISIBLE_DEVICES`` that CUDA uses, in ordinal order; None when it is not set (every
    device is visible, in ``CUDA_DEVICE_ORDER``). As CUDA does, the list ends before the first entry that is not
    an ordinal or a UUID (``-1``, a name) and before a repeated one."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    entries: list[str] = []
    for raw in value.split(","):
        entry = raw.strip()
        if not _VISIBLE_ENTRY.match(entry) or entry in entries:
            break
        entries.append(str(int(entry)) if entry.isdigit() else entry)
    return entries


def device_selector(device: int, environ: Mapping[str, str] = os.environ) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value under which a child process sees ordinal ``device`` of this one as its
    only device, ``cuda:0``: this process's own entry for it (an ordinal or UUID, kept as written), or the ordinal
    itself when ``CUDA_VISIBLE_DEVICES`` is not set (the child inherits ``CUDA_DEVICE_ORDER``, so an ordinal means
    the same device there). :class:`GpuUnavailable` when the variable hides that ordinal."""
    if device < 0:
        raise GpuUnavailable(f"CUDA device {device} does not exist: an ordinal is 0 or more")
    entries = visible_devices(environ)
    if entries is None:
        return str(device)
    if device >= len(entries):
        raise GpuUnavailable(f"CUDA device {device} is not visible: CUDA_VISIBLE_DEVICES="
                             f"{environ['CUDA_VISIBLE_DEVICES']!r} makes {len(entries)} device(s) visible")
    return entries[device]


def require_device(device: int) -> None:
    """Raise :class:`GpuUnavailable` unless torch sees CUDA device ``device`` (an ordinal of this process)."""
    import torch

    if not torch.cuda.is_available():
        raise GpuUnavailable("torch sees no CUDA device" + _visible_note())
    count = torch.cuda.device_count()
    if not 0 <= device < count:
        raise GpuUnavailable(f"CUDA device {device} does not exist ({count} visible{_visible_note()})")


def require_fe_gpu(device: int | None = 0) -> None:
    """What ``plancache.torch.install()`` needs, checked before it installs anything: torch and
    nvidia-cudnn-frontend importable and, unless ``device`` is None, CUDA device ``device`` visible to torch.
    :class:`GpuUnavailable` says which is missing and what to do."""
    try:
        import cudnn  # noqa: F401
        import torch  # noqa: F401
    except ImportError as exc:
        raise GpuUnavailable(f"plancache.torch.install() needs torch and nvidia-cudnn-frontend ({exc}): "
                             "pip install 'plancache[gpu]'") from None
    if device is None:
        return
    try:
        require_device(device)
    except GpuUnavailable as exc:
        raise GpuUnavailable(f"plancache.torch.install() serves cuDNN builds on a CUDA GPU, and {exc}: on a machine "
                             "without one, leave install() out (FE then builds as it does without plancache)") from None


def _visible_note() -> str:
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "" if value is None else f"; CUDA_VISIBLE_DEVICES={value!r}"


def detect(device: int = 0) -> Environment:
    """Fingerprint CUDA device ``device`` of this process (needs torch and nvidia-cudnn-frontend). Reads the
    device's properties only: no CUDA context is created, on it or on any other device."""
    try:
        import cudnn
        import torch
    except ImportError as exc:
        raise GpuUnavailable(f"detecting the GPU environment needs torch and nvidia-cudnn-frontend: {exc}") from exc
    require_device(device)
    props = torch.cuda.get_device_properties(device)
    return Environment(
        sm=props.major * 10 + props.minor,
        sm_count=props.multi_processor_count,
        cudnn_version=int(cudnn.backend_version()),
        driver_version=cuda_driver_version(),
        frontend_version=str(cudnn.__version__),
        device_name=str(props.name),
        cuda_runtime=str(torch.version.cuda or ""),
        torch_version=str(torch.__version__),
    )
