from ternop.checkpoint.writer import *  # noqa: F401,F403  (temporary, while the package is split)
from ternop.checkpoint.writer import _safetensors_files  # noqa: F401
