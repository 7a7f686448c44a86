"""Old path of :mod:`looplm.lens.kind` (tests name it); the module itself."""

import sys

from looplm.lens import kind

sys.modules[__name__] = kind
