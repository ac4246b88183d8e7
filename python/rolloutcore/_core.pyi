"""Type stubs of the compiled extension rolloutcore._core (src/python/module.cc)."""

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

class Publisher:
    def __init__(
        self,
        directory: str,
        model: str,
        rank: int = 0,
        world_size: int = 1,
        transport: str = "shm",
        lease_ttl_ms: int = 30000,
        keepalive_interval_ms: int = 0,
    ) -> None: ...
    def add_shard(
        self,
        version: str,
        name: str,
        array: Any,
        offset: Optional[Sequence[int]] = None,
        global_shape: Optional[Sequence[int]] = None,
        dtype: Any = None,
    ) -> None: ...
    def publish(self, version: str) -> Dict[str, Any]: ...
    def publish_empty(self, version: str) -> Dict[str, Any]: ...
    def attach_probes(self, version: str, probes_json: str) -> None: ...
    def release(self, version: str, in_directory: bool = True) -> None: ...
    def shards(self, version: str) -> List[Dict[str, Any]]: ...
    def versions(self) -> List[str]: ...
    def is_published(self, version: str) -> bool: ...
    @property
    def model(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def transport(self) -> str: ...
    @property
    def lease_id(self) -> str: ...

def allocate(shape: Sequence[int], dtype: Any) -> Any: ...
def shared_allocations() -> Tuple[int, int]: ...
def plan(
    model: str,
    source: str,
    target: str,
    rank: Optional[int] = None,
    budget: int = 64,
    layers: Optional[Tuple[int, int]] = None,
    experts: Sequence[int] = ...,
    only: Optional[str] = None,
) -> Dict[str, Any]: ...
def model_tensors(model: str) -> List[Dict[str, Any]]: ...
def trainer_shards(model: str, layout: str) -> List[Dict[str, Any]]: ...
def tensor_digest(
    array: Any, global_shape: Optional[Sequence[int]] = None, offset: Optional[Sequence[int]] = None, dtype: Any = None
) -> str: ...
def combine_digests(digests: Dict[str, Any]) -> str: ...
def transports() -> List[Dict[str, str]]: ...

# The fp8 quantizer (docs/fp8.md): bf16 bit patterns (uint16, rows x cols, rows = output channels)
# -> (E4M3FN bytes, uint8 rows x cols; float32 scales shaped (1,), (rows, 1) or the block grid), the
# bits vLLM 0.33 serves for --quantization fp8_per_tensor / fp8_per_channel / fp8_per_block.
def quantize_fp8(
    bits: Any, scheme: str = "per_tensor", block: Tuple[int, int] = (128, 128), name: str = "tensor", threads: int = 1
) -> Tuple[Any, Any]: ...
def dequantize_fp8(q: Any, scales: Any, scheme: str = "per_tensor", block: Tuple[int, int] = (128, 128)) -> Any: ...
# CUDA builds only: the same rule on the GPU, on device addresses (the vLLM extension's FP8 refit).
def quantize_fp8_device(
    device: int, bf16: int, rows: int, cols: int, scheme: str, q: int, scales: int,
    block: Tuple[int, int] = (128, 128), name: str = "tensor"
) -> None: ...

fp8_quantize_isa: str

# True in CUDA builds (ROLLOUTCORE_WITH_CUDA): Publisher.add_shard then takes CUDA tensors
# (transport "cuda_ipc"; the shard digest is computed on the GPU), and DeviceStager exists.
cuda_built: bool

class DeviceStager:
    """CUDA builds only: the C++ half of rolloutcore.vllm (plan, pull into GPU staging, digests).

    It is the extension's live weights (receiver::DeviceLiveWeights): ``staging_buffers`` and
    ``live_buffers`` return ``{name: (device address, bytes)}`` of the staging image and the live
    parameters when the stager asks (at each stage, digest, prepare and install)."""

    def __init__(
        self,
        device: int,
        staging_buffers: Callable[[], Dict[str, Tuple[int, int]]],
        live_buffers: Callable[[], Dict[str, Tuple[int, int]]],
    ) -> None: ...
    def set_captures(
        self,
        staging_params: List[Tuple[str, str, List[int]]],
        staging_copies: List[Dict[str, Any]],
        live_params: List[Tuple[str, str, List[int]]],
        live_copies: List[Dict[str, Any]],
    ) -> None: ...
    def stage(
        self, directory: str, model: str, version: str, timeout_ms: int, pull_delay_ms: int = 0,
        delta_policy: str = "auto",
    ) -> Dict[str, Any]: ...
    def live_digest(self) -> Dict[str, Any]: ...
    def prepare_install(self) -> Dict[str, Any]: ...
    def install(self) -> Dict[str, Any]: ...
    def prepare_exchange(self, live_after: Dict[str, Tuple[int, int]]) -> Dict[str, Any]: ...
    def complete_exchange(self, reread: bool = True) -> Dict[str, Any]: ...
