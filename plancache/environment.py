"""The GPU environment fingerprint a plan is valid for, and its detection on this machine.

A plan is only valid on the same SM (compute capability), SM count, exact cuDNN backend
version, CUDA driver version and cuDNN frontend version: these are the *validity* fields.
Device name, CUDA runtime and torch version are kept for information only.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from .errors import GpuUnavailable

VALIDITY_FIELDS: tuple[str, ...] = ("sm", "sm_count", "cudnn_version", "driver_version", "frontend_version")
INFO_FIELDS: tuple[str, ...] = ("device_name", "cuda_runtime", "torch_version")


def refuse_bool(value: Any) -> Any:
    """Before an integer field is validated: pydantic's lax mode would read ``true``/``false`` as 1/0."""
    if isinstance(value, bool):
        raise ValueError("Input should be an integer, not a boolean")
    return value


#: An integer field of the wire models: lax (``"5"`` from a query string is 5) but never a boolean.
Int = Annotated[int, BeforeValidator(refuse_bool)]


class Environment(BaseModel):
    """A GPU environment. ``sm`` is major*10+minor (90 for an H100/H200)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sm: Int = Field(ge=10, le=1000, description="compute capability, major*10+minor")
    sm_count: Int = Field(ge=1, le=100_000)
    cudnn_version: Int = Field(ge=1, le=2**31 - 1, description="cuDNN backend version, e.g. 91900")
    driver_version: Int = Field(ge=1, le=2**31 - 1, description="CUDA driver API version, e.g. 13000")
    frontend_version: str = Field(min_length=1, max_length=64, description="nvidia-cudnn-frontend version")
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

    def compatible_with(self, other: "Environment") -> bool:
        return self.validity() == other.validity()

    def describe(self) -> str:
        name = self.device_name or "GPU"
        return (
            f"{name} sm_{self.sm} x{self.sm_count} SMs, cuDNN {self.cudnn_version}, "
            f"driver {self.driver_version}, frontend {self.frontend_version}"
        )


def environment_id(validity: dict[str, Any]) -> str:
    canon = json.dumps({f: validity[f] for f in VALIDITY_FIELDS}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:32]


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


def detect(device: int = 0) -> Environment:
    """Fingerprint CUDA device ``device`` of this process (needs torch and nvidia-cudnn-frontend)."""
    try:
        import cudnn
        import torch
    except ImportError as exc:
        raise GpuUnavailable(f"detecting the GPU environment needs torch and nvidia-cudnn-frontend: {exc}") from exc
    if not torch.cuda.is_available():
        raise GpuUnavailable("torch sees no CUDA device")
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
