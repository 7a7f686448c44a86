"""Old path of :mod:`looplm.adaptive.halting` (tests and docs name it); the module itself."""

import sys

from looplm.adaptive import halting

sys.modules[__name__] = halting
