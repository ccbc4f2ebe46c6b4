"""Old home of ``RemoteEngine``: the generic Ray host now lives in ``rollout/engines/remote.py`` (it hosts any engine,
not only the CPU one). This name is that very module, so imports and monkeypatches of either path agree."""
import sys

from megatron_s3ac.rollout.engines import remote as _remote

sys.modules[__name__] = _remote
