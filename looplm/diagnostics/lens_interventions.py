"""Old path of :mod:`looplm.lens.interventions` (tests and docs name it); the module itself."""

import sys

from looplm.lens import interventions

sys.modules[__name__] = interventions
