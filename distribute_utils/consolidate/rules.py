"""Internal. Where merge rules were defined before they got modules of their own; kept for the names imported from
here: the rule classes are in :mod:`.merge_rules`, rule tables in :mod:`.rule_table`, ModelOpt's
quantization rules in :mod:`.quant_rules`, and :func:`~.merge_write.write_merged` merges and writes.
"""

from __future__ import annotations

from ..errors import MergeError, RuleSyntaxError
from .quant_rules import quantized_rule

__all__ = ["MergeError", "RuleSyntaxError", "quantized_rule"]
