"""Old path of :mod:`looplm.adaptive.depth` (tests and docs name it); the module itself."""

import sys

from looplm.adaptive import depth

sys.modules[__name__] = depth
