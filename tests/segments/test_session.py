"""The routing header's family (``kv_transfer_params["kmesh_session"]``, set by
`kmesh_blend.vllm.family_header.FamilyHeader`) on the engine side, and the client side's header."""

from __future__ import annotations

import pytest

from kmesh_blend.routing import RoutingError, end_session, session_headers
from kmesh_blend.segments.annotation import MAX_FAMILY_LEN, SESSION_KEY, parse_request
from kmesh_blend.segments.client import Encoded
from tests.segments.conftest import _free_port

IDS = [5, 6, 7, 9, 8, 8, 9, 4, 4]  # separator 9: segments [0, 3) and [4, 6), question [7, 9)


def _parse(params: object, separator: list[int] | None = None):  # type: ignore[no-untyped-def]
    return parse_request(params, len(IDS), max_model_len=64, token_ids=IDS, separator=separator)


def test_the_session_names_the_family_of_an_annotation_without_one() -> None:
    parsed = _parse({"kmesh": {"segments": [[0, 3]]}, SESSION_KEY: "agents-1"})
    assert parsed.annotation is not None and parsed.annotation.family == "agents-1"
    assert parsed.annotation.spans == ((0, 3),)


def test_an_annotations_own_family_wins_over_the_session() -> None:
    parsed = _parse({"kmesh": {"segments": [[0, 3]], "family": "mine"}, SESSION_KEY: "user-7"})
    assert parsed.annotation is not None and parsed.annotation.family == "mine"


def test_separator_mode_takes_the_family_from_the_session_alone() -> None:
    parsed = _parse({SESSION_KEY: "agents-2"}, separator=[9])
    assert parsed.annotation is not None and parsed.annotation.source == "separator"
    assert parsed.annotation.family == "agents-2"
    assert parsed.annotation.spans == ((0, 3), (4, 6))
    # With an annotation carrying only lifetimes, the session still fills the family.
    closing = _parse({"kmesh": {"close": True}, SESSION_KEY: "agents-2"}, separator=[9])
    assert closing.annotation is not None and closing.annotation.family == "agents-2"
    assert closing.annotation.close


def test_without_separator_mode_a_session_alone_annotates_nothing() -> None:
    assert _parse({SESSION_KEY: "agents-3"}) == (None, None)  # routed, served stock, no report


@pytest.mark.parametrize("bad", ["", "x" * (MAX_FAMILY_LEN + 1), 7, ["a"]])
def test_a_bad_session_falls_back_naming_its_field(bad: object) -> None:
    parsed = _parse({"kmesh": {"segments": [[0, 3]]}, SESSION_KEY: bad})
    assert parsed.annotation is None
    assert parsed.fallback is not None and parsed.fallback.startswith("bad annotation: kmesh_se")


def test_routed_gives_the_body_and_the_header_together() -> None:
    routed = Encoded([1, 2, 3, 4], [(1, 3)]).routed(family="fam-9", close=True, round=2)
    assert routed.headers == {"X-Session-ID": "fam-9"}
    kmesh = routed.extra_body["kv_transfer_params"]["kmesh"]
    assert kmesh == {"segments": [[1, 3]], "family": "fam-9", "round": 2, "close": True}
    parsed = parse_request(routed.extra_body["kv_transfer_params"], 4, max_model_len=8)
    assert parsed.annotation is not None and parsed.annotation.close


@pytest.mark.parametrize("bad", ["", "a\nb", "fam\u00e9", "x" * (MAX_FAMILY_LEN + 1)])
def test_a_family_no_header_can_carry_is_refused_on_the_client(bad: str) -> None:
    with pytest.raises(ValueError, match="family="):
        session_headers(bad)


def test_end_session_names_a_router_that_does_not_answer() -> None:
    router = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(RoutingError, match=f"router {router}: finish_session for 'f' failed"):
        end_session(router, "f", timeout_s=2.0)
