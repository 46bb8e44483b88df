"""Domain errors. Every layer raises these; the server maps them to HTTP statuses in one place."""

from __future__ import annotations


class PlanCacheError(Exception):
    """Base of every plancache error. ``code`` is a stable machine-readable name."""

    code = "plancache_error"
    http_status = 400

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class SpecError(PlanCacheError):
    """A GraphSpec is malformed: unknown op, dangling tensor, shape or dtype mismatch."""

    code = "invalid_spec"
    http_status = 422


class NotFound(PlanCacheError):
    code = "not_found"
    http_status = 404


class Conflict(PlanCacheError):
    """The request contradicts stored state (e.g. a different blob for an existing plan)."""

    code = "conflict"
    http_status = 409


class IntegrityError(PlanCacheError):
    """Bytes do not match their declared digest or size."""

    code = "integrity_error"
    http_status = 422


class LeaseLost(PlanCacheError):
    """A job heartbeat/completion came from a holder whose lease was taken over (fenced)."""

    code = "lease_lost"
    http_status = 409


class Unauthorized(PlanCacheError):
    code = "unauthorized"
    http_status = 401


class Forbidden(PlanCacheError):
    code = "forbidden"
    http_status = 403


class PayloadTooLarge(PlanCacheError):
    code = "payload_too_large"
    http_status = 413


class EnvironmentMismatch(PlanCacheError):
    """A plan was built for another GPU environment than the one asking."""

    code = "environment_mismatch"
    http_status = 409


class VerificationError(PlanCacheError):
    """A blob failed verification (size, digest, signature, key, environment); ``reason`` says which."""

    code = "verification_failed"
    http_status = 422

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class SignatureError(VerificationError):
    def __init__(self, message: str, reason: str = "signature") -> None:
        super().__init__(reason, message)


class GpuUnavailable(PlanCacheError):
    """No CUDA device, no cuDNN, or no nvidia-cudnn-frontend in this process."""

    code = "gpu_unavailable"
    http_status = 503


class InsufficientGpuMemory(PlanCacheError):
    """The spec needs more device memory than the GPU has; refused before allocating."""

    code = "insufficient_gpu_memory"
    http_status = 422


class TuningError(PlanCacheError):
    """No candidate plan built, ran and matched the reference."""

    code = "tuning_failed"
    http_status = 422


class DynamicShapesUnsupported(TuningError):
    """The graph cannot be built with dynamic shapes from a shared kernel cache."""

    code = "dynamic_shapes_unsupported"


class PlanMiss(PlanCacheError):
    """Strict mode: no verified plan was available and building locally is not allowed."""

    code = "plan_miss"
    http_status = 404
