"""Old path of :mod:`looplm.lens.structure` (tests and docs name it); the module itself."""

import sys

from looplm.lens import structure

sys.modules[__name__] = structure
