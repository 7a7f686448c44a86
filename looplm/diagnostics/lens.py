"""Old path of the Jacobian lens (tests and notebooks import it): :mod:`looplm.lens.jacobian`
and :mod:`looplm.lens.readout` under one name. New code imports :mod:`looplm.lens`."""

from looplm.lens.jacobian import *  # noqa: F403
from looplm.lens.readout import *  # noqa: F403
