"""The HLO collective parser on hand-written programs in the forms XLA prints."""

from noloco_jax.tools import hlo
import hlo_helpers  # pylint: disable=g-bad-import-order  (tests/hlo_helpers.py)

_HLO = """
HloModule jit_f

%region_0 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(f32[] %a, f32[] %b)
}

ENTRY %main (param.2: f32[1,5], p2: bf16[3]) -> (f32[1,5], f32[3], f32[4,2]) {
  %param.2 = f32[1,5]{1,0} parameter(0)
  %p2 = bf16[3]{0} parameter(1)
  %ppermute.3 = f32[1,5]{1,0} collective-permute(%param.2), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %cp-start = (f32[1,5]{1,0}, f32[1,5]{1,0}, u32[], u32[]) collective-permute-start(%param.2), channel_id=2
  %cp-done = f32[1,5]{1,0} collective-permute-done(%cp-start)
  %wrapped_convert = f32[3]{0} convert(%p2)
  %ar = f32[3]{0} all-reduce(%wrapped_convert), channel_id=3, replica_groups={{0,1}}, to_apply=%region_0
  %c = f32[4,2]{1,0} constant({...})
  %ars = (f32[4,2]{1,0}, f32[3]{0}) all-reduce-start(f32[4,2]{1,0} %c, f32[3]{0} %ar), to_apply=%region_0
  ROOT %t = (f32[1,5]{1,0}, f32[3]{0}, f32[4,2]{1,0}) tuple(%ppermute.3, %ar, %c)
}
"""


def test_operand_bytes_of_sync_and_async_collectives():
  # The async start returns (input, output, contexts): only its operand, the 20-byte message, counts.
  assert hlo.collective_ops(_HLO, "collective-permute") == [20, 20]
  # Operands by name (looked up) and with inline shapes (older printers) both count.
  assert hlo.collective_ops(_HLO, "all-reduce") == [12, 32 + 12]
  assert hlo.all_collective_bytes(_HLO) == {"collective-permute": 40, "all-reduce": 56}
  assert hlo.collective_bytes(_HLO, "all-gather") == 0


def test_stablehlo_permute_bytes():
  text = ('%0 = "stablehlo.collective_permute"(%arg0) <{source_target_pairs = dense<[[0, 1]]> : tensor<1x2xi64>}> '
          ': (tensor<1x17xbf16>) -> tensor<1x17xbf16>')
  assert hlo_helpers.stablehlo_collective_bytes(text) == 34


def test_parameter_copies_counts_copied_parameters_only():
  text = """ENTRY %main (p.0: f32[4], p.1: f32[2]) -> (f32[4], f32[4], f32[2]) {
  %p.0 = f32[4]{0} parameter(0)
  %p.1 = f32[2]{0} parameter(1)
  %add = f32[4]{0} add(%p.0, %p.0)
  %copy = f32[4]{0} copy(%add)
  %copy.1 = f32[2]{0} copy(%p.1)
  ROOT %tuple = (f32[4]{0}, f32[4]{0}, f32[2]{0}) tuple(%add, %copy, %copy.1)
}"""
  assert hlo.parameter_copies(text) == 8  # p.1 copied (2 × f32); the copy of a computed value is not
