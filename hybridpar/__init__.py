"""hybridpar: Llama training with tensor parallelism inside a node and FSDP hybrid sharding across nodes."""

from .mesh import MeshSizeError, ParallelDims, init_parallel

__version__ = "0.1.0"
__all__ = ["init_parallel", "ParallelDims", "MeshSizeError", "__version__"]
