"""hybridpar: Llama training with tensor parallelism inside a node and FSDP hybrid sharding across nodes."""

__version__ = "0.1.0"
__all__ = ["init_parallel", "ParallelDims", "MeshSizeError", "__version__"]


def _bind_checkout_models() -> None:
    # models/ stands at the checkout's top (the model card); setup.cfg's package_dir makes it
    # hybridpar.models in a wheel, which holds a real hybridpar/models/. A checkout on sys.path
    # (PYTHONPATH=$PWD, the processes tests start) has no such mapping, and an editable install of
    # another checkout would lend ITS models/: so a checkout binds the models/ beside this package.
    # Cheap: models/__init__.py is empty, its modules load on first use.
    import importlib.util
    import os
    import sys

    package = os.path.dirname(os.path.abspath(__file__))
    source = os.path.join(os.path.dirname(package), "models", "__init__.py")
    marker = os.path.join(os.path.dirname(package), "setup.cfg")
    if os.path.isfile(os.path.join(package, "models", "__init__.py")) or not (
            os.path.isfile(source) and os.path.isfile(marker)):
        return  # installed from a wheel (or not a checkout)
    spec = importlib.util.spec_from_file_location(f"{__name__}.models", source,
                                                  submodule_search_locations=[os.path.dirname(source)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    globals()["models"] = module  # as the import system sets a submodule on its parent


_bind_checkout_models()


def __getattr__(name: str):
    # On first use: importing the package must not import torch (a data-preparation worker, --help).
    if name in ("init_parallel", "ParallelDims"):
        from .mesh import device

        return getattr(device, name)
    if name == "MeshSizeError":
        from .mesh.layout import MeshSizeError

        return MeshSizeError
    raise AttributeError(f"module 'hybridpar' has no attribute {name!r}")
