"""The base of every config section: unknown keys refused, fields documented where declared."""

from typing import Literal

from pydantic import BaseModel, ConfigDict

from pipeline.errors import UserError


# Kept in sync with pipeline.learning.losses.LOSS_TYPES by a unit test; listed here so that
# loading a config never imports torch.
LossType = Literal["gepo", "grpo", "dr_grpo", "bnpo", "gspo", "gmpo", "cispo", "topr"]


class ConfigError(UserError, ValueError):
    """A config file or override that cannot be used; the message names the field."""


class Strict(BaseModel):
    """A config section: unknown keys are refused, assignments validated."""

    # Attribute docstrings become field descriptions: the docs live beside each field.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)
