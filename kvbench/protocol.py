"""The backend protocol under its original import path, for plug-ins written against it
(``from kvbench.protocol import Backend, ...``). It lives in :mod:`kvbench.contract.protocol`."""
from kvbench.contract.protocol import *  # noqa: F401,F403
from kvbench.contract.protocol import __all__  # noqa: F401
