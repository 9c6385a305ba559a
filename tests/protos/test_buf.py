"""The gRPC contract under buf (docs/grpc.md): the protos pass ``buf lint``, and the working
tree breaks neither the public files (FILE) nor any file's encoding (WIRE) against the
release baseline, protos/baseline/v1.binpb. A copy with a renumbered field fails with buf's
own message; a copy with an added field passes."""

from __future__ import annotations

import pathlib

import pytest

from .buf import breaking_internal, breaking_public, buf_or_skip, copy_contract, edit, lint

V1 = pathlib.Path("protos/continuum/v1")


@pytest.fixture
def contract(tmp_path) -> pathlib.Path:
    buf_or_skip()
    return copy_contract(tmp_path)


def test_the_protos_pass_buf_lint():
    outcome = lint()
    assert outcome.code == 0, outcome.output


def test_the_tree_keeps_the_released_contract():
    public, internal = breaking_public(), breaking_internal()
    assert public.code == 0, public.output
    assert internal.code == 0, internal.output


def test_a_renumbered_public_field_is_breaking(contract):
    edit(contract / V1 / "generation.proto", "string tenant = 8;", "string tenant = 12;")
    outcome = breaking_public(contract)
    assert outcome.code != 0
    assert ('Previously present field "8" with name "tenant" on message "GenerateRequest" '
            "was deleted") in outcome.output, outcome.output


def test_a_renumbered_internal_field_is_breaking_on_the_wire(contract):
    edit(contract / V1 / "scheduler.proto", "uint32 max_tokens = 4;", "uint32 max_tokens = 40;")
    outcome = breaking_internal(contract)
    assert outcome.code != 0
    assert ('Previously present field "4" with name "max_tokens" on message "SubmitRequest" '
            'was deleted without reserving the number "4"') in outcome.output, outcome.output


def test_added_fields_break_nothing(contract):
    edit(contract / V1 / "generation.proto", "  uint32 n = 11;\n",
         "  uint32 n = 11;\n  // A field a later release adds.\n  string added = 12;\n")
    edit(contract / V1 / "scheduler.proto", "  uint32 num_resumed_output_tokens = 7;\n",
         "  uint32 num_resumed_output_tokens = 7;\n  uint32 added = 8;\n")
    for outcome in (lint(contract), breaking_public(contract), breaking_internal(contract)):
        assert outcome.code == 0, outcome.output


def test_an_internal_field_may_be_renamed_but_a_public_one_may_not(contract):
    """The categories' difference: an internal name is nobody's but this repository's, a
    public name is in every client's generated code and JSON."""
    edit(contract / V1 / "scheduler.proto", "string tenant = 5;", "string tenant_name = 5;")
    assert breaking_internal(contract).code == 0
    assert breaking_public(contract).code == 0  # the public check ignores internal files
    edit(contract / V1 / "generation.proto", "string tenant = 8;", "string tenant_name = 8;")
    outcome = breaking_public(contract)
    assert outcome.code != 0
    assert 'changed name from "tenant" to "tenant_name"' in outcome.output, outcome.output
