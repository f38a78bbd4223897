"""chunked_offload: keep optimizer state in host memory and step it chunk by chunk on the GPU."""

from .adapters import Adapter, GenericAdapter, KeyedAdapter, TEFusedAdamAdapter
from .bounced import ChunkIntegrityError
from .host_arena import HostArena
from .layout import IncompatibleStateError
from .masters import MasterMode
from .notices import ChunkedOffloadWarning
from .optimizer import ChunkedOffloadOptimizer
from .phase import Phase
from .planner import Bundle, Chunk, ChunkPlan, Home, Role, TensorSpec, plan_chunks
from .state_dict import MASTER_KEY

__version__ = "0.2.0"  # the one place the version is kept (pyproject.toml reads it)

__all__ = [
    "MASTER_KEY",
    "Adapter",
    "Bundle",
    "Chunk",
    "ChunkIntegrityError",
    "ChunkPlan",
    "ChunkedOffloadOptimizer",
    "ChunkedOffloadWarning",
    "GenericAdapter",
    "Home",
    "HostArena",
    "IncompatibleStateError",
    "KeyedAdapter",
    "MasterMode",
    "Phase",
    "Role",
    "TEFusedAdamAdapter",
    "TensorSpec",
    "__version__",
    "plan_chunks",
]
