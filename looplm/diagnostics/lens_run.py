"""Old path of :mod:`looplm.lens.analysis` (tests and docs name it); the module itself."""

import sys

from looplm.lens import analysis

sys.modules[__name__] = analysis
