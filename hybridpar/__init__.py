"""hybridpar: Llama training with tensor parallelism inside a node and FSDP hybrid sharding across nodes."""

__version__ = "0.1.0"
__all__ = ["init_parallel", "ParallelDims", "MeshSizeError", "__version__"]


def __getattr__(name: str):
    # On first use: importing the package must not import torch (a data-preparation worker, --help).
    if name in ("init_parallel", "ParallelDims"):
        from .mesh import device

        return getattr(device, name)
    if name == "MeshSizeError":
        from .mesh.layout import MeshSizeError

        return MeshSizeError
    raise AttributeError(f"module 'hybridpar' has no attribute {name!r}")
