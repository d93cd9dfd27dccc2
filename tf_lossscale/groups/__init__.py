"""Optimizer groups: `LossScaleGroup`, one loss scale for several optimizers,
and its `GroupMember`s (who steps when, once per iteration)."""

from tf_lossscale.groups.group import LossScaleGroup, group_of
from tf_lossscale.groups.member import GroupMember, underlying
