"""Old path of :mod:`looplm.lens.section`, the lens report section (tests and docs name it): the
module itself, under this name too. That module reads store records only, as everything under
``looplm.results`` does."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("looplm.lens.section")
