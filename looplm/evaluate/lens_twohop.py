"""Old path of :mod:`looplm.lens.twohop` (tests name it); the module itself."""

import sys

from looplm.lens import twohop

sys.modules[__name__] = twohop
