"""benchmarks/peer_tests.py's pure parts: ServerProcess settings to an orin-llm profile and
to llama-server's flags, the outcome of a test per server, and the report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks import peer_tests as pt
from orin.profile.schema import Profile

MODEL = Path("/models/smollm2.gguf")

# ServerPreset.tinyllama2()'s settings
TINYLLAMA2 = {
    "offline": True,
    "model_hf_repo": "ggml-org/test-model-stories260K",
    "model_hf_file": None,
    "model_alias": "tinyllama-2",
    "n_ctx": 512,
    "n_batch": 32,
    "n_slots": 2,
    "n_predict": 64,
    "seed": 42,
}


def test_tinyllama2_becomes_a_valid_profile() -> None:
    setup = pt.orin_setup(TINYLLAMA2, MODEL, 8123)
    p = setup.profile
    assert p["engine"]["slots"] == 2
    assert p["engine"]["n_ctx"] == 256  # llama.cpp's -c is shared by the slots
    assert p["engine"]["n_batch"] == 32
    assert p["engine"]["n_ubatch"] == 32  # never above n_batch
    assert (p["engine"]["type_k"], p["engine"]["type_v"]) == ("f16", "f16")
    assert p["sampling"] == {"temperature": 0.8, "seed": 42, "max_tokens": 64}
    assert p["server"]["model_name"] == "tinyllama-2"
    assert p["server"]["port"] == 8123
    assert p["context"]["sliding"] is False  # llama-server without --context-shift
    assert p["model"] == {"path": str(MODEL)}
    assert setup.unsupported == {}
    assert setup.approximated == {}
    Profile.model_validate(p)


def test_values_below_orin_minimums_are_raised_and_recorded() -> None:
    setup = pt.orin_setup({**TINYLLAMA2, "n_batch": 16, "n_ctx": 256, "n_slots": 4}, MODEL, 1)
    assert setup.profile["engine"]["n_batch"] == 32
    assert setup.profile["engine"]["n_ctx"] == 256
    assert set(setup.approximated) == {"n_batch", "n_ctx"}
    Profile.model_validate(setup.profile)


def test_unset_slots_are_llama_servers_auto() -> None:
    setup = pt.orin_setup({"n_ctx": 1024}, MODEL, 1)
    assert setup.profile["engine"]["slots"] == pt.AUTO_SLOTS
    assert setup.profile["engine"]["n_ctx"] == 256
    assert "n_slots" in setup.approximated


def test_api_key_goes_through_the_environment() -> None:
    setup = pt.orin_setup({**TINYLLAMA2, "api_key": "s3cret"}, MODEL, 1)
    var = setup.profile["server"]["api_key_env"]
    assert setup.env == {var: "s3cret"}
    assert pt.orin_setup(TINYLLAMA2, MODEL, 1).profile["server"]["api_key_env"] is None


@pytest.mark.parametrize(
    ("value", "template", "approximated"),
    [
        ("llama3", None, True),
        ("command-r", None, True),
        ("{{ messages[0].content }}", "{{ messages[0].content }}", False),
        ("This is not a chat template, it is", "This is not a chat template, it is", False),
    ],
)
def test_chat_template_names_are_approximated_texts_are_templates(
    value: str, template: str | None, approximated: bool
) -> None:
    setup = pt.orin_setup({**TINYLLAMA2, "chat_template": value}, MODEL, 1)
    assert setup.profile["model"].get("chat_template") == template
    assert ("chat_template" in setup.approximated) is approximated
    assert setup.unsupported == {}


def test_chat_template_file_is_read() -> None:
    seen: list[str] = []

    def read(path: str) -> str:
        seen.append(path)
        return "{{ bos_token }}"

    settings = {**TINYLLAMA2, "jinja": True, "chat_template_file": "../t.jinja"}
    setup = pt.orin_setup(settings, MODEL, 1, read_text=read)
    assert seen == ["../t.jinja"]
    assert setup.profile["model"]["chat_template"] == "{{ bos_token }}"


def test_pooling_and_features() -> None:
    setup = pt.orin_setup(
        {**TINYLLAMA2, "pooling": "last", "debug": True, "kv_unified": True}, MODEL, 1
    )
    assert setup.profile["model"]["pooling"] == "last"
    assert set(setup.unsupported) == {"debug", "kv_unified"}
    assert "pooling" in pt.orin_setup({"pooling": "none"}, MODEL, 1).unsupported


def test_negative_n_predict_and_seed() -> None:
    setup = pt.orin_setup({**TINYLLAMA2, "n_predict": -1, "seed": -1}, MODEL, 1)
    assert "max_tokens" not in setup.profile["sampling"]
    assert "seed" not in setup.profile["sampling"]
    assert "n_predict" in setup.approximated


def test_llama_server_argv() -> None:
    argv = pt.llama_server_argv(
        {**TINYLLAMA2, "jinja": True, "fa": "on", "server_embeddings": True},
        Path("/bin/llama-server"),
        MODEL,
        9000,
    )
    joined = " ".join(argv)
    assert argv[0] == "/bin/llama-server"
    assert f"--model {MODEL}" in joined
    assert "--ctx-size 512" in joined and "--parallel 2" in joined
    assert "--batch-size 32" in joined and "--n-predict 64" in joined
    assert "--alias tinyllama-2" in joined and "--port 9000" in joined
    assert "-fa on" in joined and "--embedding" in argv
    assert "--jinja" in argv and "--no-slots" in argv
    assert "--hf-repo" not in joined
    plain = pt.llama_server_argv({}, Path("/bin/llama-server"), MODEL, 1)
    assert "--no-jinja" in plain and "--temp" in plain


@pytest.mark.parametrize(
    ("method", "path", "sent", "is_offered"),
    [
        ("POST", "/chat/completions", "/v1/chat/completions", True),
        ("POST", "/v1/chat/completions", "/v1/chat/completions", True),
        ("GET", "/models", "/v1/models", True),
        ("POST", "/completion", "/completion", False),
        ("POST", "/completions", "/completions", False),
        ("POST", "/embeddings", "/embeddings", False),
        ("POST", "/tokenize", "/tokenize", True),
        ("GET", "/slots", "/slots", False),
        ("GET", "/v1/stream?conv_id=x", "/v1/stream?conv_id=x", False),
    ],
)
def test_paths(method: str, path: str, sent: str, is_offered: bool) -> None:
    assert pt.orin_path(method, path) == sent
    assert pt.offered(method, path) is is_offered


def event(path: str, status: int | None, response: str = "{}", method: str = "POST") -> dict:
    return {"method": method, "path": path, "sent": pt.orin_path(method, path), "body": "{}",
            "status": status, "response": response}  # fmt: skip


def rec(outcome: str, events: list[dict[str, Any]] | None = None, **more: Any) -> dict:
    return {"id": "unit/test_x.py::t", "outcome": outcome, "events": events or [], **more}


def test_outcome_not_offered_by_endpoint() -> None:
    r = rec("failed", [event("/completion", 404)], message="assert 404 == 200")
    assert pt.outcome(pt.ORIN, r) == {
        "status": "not offered",
        "detail": "endpoint POST /completion",
    }
    # llama-server has every endpoint: a failure stays one
    assert pt.outcome(pt.LLAMA, r)["status"] == "failed"


def test_outcome_not_offered_by_feature_needs_evidence() -> None:
    verbose = rec("failed", [event("/chat/completions", 200)], message="assert '__verbose' in {}",
                  unsupported={"debug": pt.FEATURES["debug"][0]})  # fmt: skip
    assert pt.outcome(pt.ORIN, verbose)["status"] == "not offered"
    other = dict(verbose, message="assert 3 == 8")
    assert pt.outcome(pt.ORIN, other)["status"] == "failed"
    slots = rec("failed", message="KeyError", unsupported={"kv_unified": "x"})
    assert pt.outcome(pt.ORIN, slots)["status"] == "not offered"
    router = rec("error", not_offered="router mode")
    assert pt.outcome(pt.ORIN, router) == {"status": "not offered", "detail": "router mode"}


def test_outcome_model_dependent() -> None:
    r = rec("failed", [event("/chat/completions", 200)],
            line="assert res.body['usage']['prompt_tokens'] == n_prompt")  # fmt: skip
    assert pt.outcome(pt.ORIN, r)["model_dependent"] is True
    r = rec("failed", [event("/chat/completions", 200)], line="assert res.status_code == 400")
    assert pt.outcome(pt.ORIN, r)["model_dependent"] is False
    assert "model_dependent" not in pt.outcome(pt.ORIN, rec("passed"))


def test_error_message() -> None:
    assert pt.error_message('{"error": {"message": "n > 1 is not supported"}}') == (
        "n > 1 is not supported"
    )
    assert pt.error_message({"detail": "Not Found"}) == "Not Found"
    assert pt.error_message("plain text") == "plain text"


def report_of() -> dict[str, Any]:
    refused = event("/chat/completions", 400, '{"error": {"message": "`n` > 1 is not supported"}}')
    answered = event("/chat/completions", 200, '{"choices": [{}, {}]}')
    orin = [
        rec("passed", id="a"),
        rec("failed", [refused], id="b", message="assert 400 == 200",
            line="assert res.status_code == 200"),
        rec("failed", [event("/completion", 404)], id="c"),
        rec("skipped", id="d", message="slow"),
        rec("failed", [answered], id="e", message="assert False", line="assert match_regex(r, c)"),
    ]  # fmt: skip
    llama = [
        rec("passed", id="a"),
        rec("passed", [answered], id="b"),
        rec("passed", id="c"),
        rec("skipped", id="d"),
        rec("failed", [answered], id="e", line="assert match_regex(r, c)"),
    ]
    return pt.build_report({pt.ORIN: orin, pt.LLAMA: llama}, {"date": "today", "cores": 2})


def test_build_report() -> None:
    report = report_of()
    assert report["totals"][pt.ORIN] == {
        "passed": 1, "failed": 2, "error": 0, "skipped": 1, "not offered": 1,
    }  # fmt: skip
    assert report["totals"][pt.LLAMA]["passed"] == 3
    assert [t["id"] for t in report["tests"]] == ["a", "b", "c", "d", "e"]
    b, e = report["orin_failures"]
    assert b["id"] == "b"
    assert b["cause"] == "400 from POST /v1/chat/completions: `n` > 1 is not supported"
    assert b["request"]["path"] == "/chat/completions"
    assert b["orin_answer"].startswith("400 `n` > 1")
    assert b["llama_server_answer"].startswith("200 ")
    assert b["model_dependent"] is False
    assert e["model_dependent"] is True and e["llama_server_same_line"] is True


def test_only_one_server() -> None:
    report = pt.build_report({pt.ORIN: [rec("failed", id="x", message="boom")]}, {})
    assert report["orin_failures"][0]["llama_server"] == "not run"
    assert report["orin_failures"][0]["llama_server_answer"] == "-"
    md = pt.render_markdown(report)
    assert "| outcome | orin-llm |\n" in md
    assert "(llama-server: not run)" in md


def test_render_markdown() -> None:
    md = pt.render_markdown(report_of())
    assert md.startswith(pt.BEGIN) and md.rstrip().endswith(pt.END)
    assert "| outcome | orin-llm | llama-server |" in md
    assert "| passed | 1 | 3 |" in md
    assert "| not offered | 1 | 0 |" in md
    assert "| total | 5 | 5 |" in md
    failures = md.split("### orin-llm failures")[1].split("<details>")[0]
    lines = [x for x in failures.splitlines() if x.startswith("- ")]
    assert lines[0].startswith("- `b`: 400 from POST /v1/chat/completions")
    assert lines[1].startswith("- `e` *model*: `assert match_regex(r, c)`")
    own, shared = failures.split("#### ")[1:]
    assert own.startswith("Where llama-server passes") and "`b`" in own and "`e`" not in own
    assert shared.startswith("Where llama-server fails at the same assertion (1)")
    assert "| `c` | not offered: endpoint POST /completion | passed |" in md


def test_write_section_replaces_the_marked_part(tmp_path: Path) -> None:
    doc = tmp_path / "conformance.md"
    pt.write_section(doc, f"{pt.BEGIN}\nold\n{pt.END}\n")
    assert doc.read_text() == f"{pt.BEGIN}\nold\n{pt.END}\n"
    doc.write_text(f"# Title\n\nintro\n\n{pt.BEGIN}\nold\n{pt.END}\n\nafter\n")
    pt.write_section(doc, f"{pt.BEGIN}\nnew\n{pt.END}\n")
    assert doc.read_text() == f"# Title\n\nintro\n\n{pt.BEGIN}\nnew\n{pt.END}\n\nafter\n"


def test_failure_cause_is_the_error_only_where_llama_server_answered_otherwise() -> None:
    refused = event("/chat/completions", 400, '{"error": {"message": "too long"}}')
    r = rec("failed", [refused], message="assert 'x' == 'exceed_context_size_error'")
    assert pt.failure_cause(r, refused, None).startswith("400 from POST /v1/chat/completions")
    assert pt.failure_cause(r, refused, event("/chat/completions", 200)).startswith("400 from")
    same = event("/chat/completions", 400)
    assert pt.failure_cause(r, refused, same) == "assert 'x' == 'exceed_context_size_error'"


def test_settings_noted() -> None:
    r = rec("failed", starts=[{"unsupported": {"debug": "x"}, "approximated": {"n_batch": "y"}},
                              {"approximated": {"n_batch": "y"}}])  # fmt: skip
    assert pt.settings_noted(r) == ["debug", "n_batch"]


def test_a_passing_test_of_an_endpoint_orin_lacks_is_not_offered() -> None:
    r = rec("passed", [event("/completion", 404)])
    assert pt.outcome(pt.ORIN, r)["status"] == "not offered"
    # an unsupported setting alone does not undo a pass
    r = rec("passed", [event("/chat/completions", 200)], unsupported={"kv_unified": "x"})
    assert pt.outcome(pt.ORIN, r)["status"] == "passed"


def test_failure_cause_names_the_assertion() -> None:
    r = rec(
        "failed", line='assert body["fp"].startswith("b")', message="AssertionError: assert False"
    )
    assert pt.failure_cause(r, None) == '`assert body["fp"].startswith("b")`'
    r = rec("failed", line="assert res.status_code == 400", message="assert 200 == 400")
    assert pt.failure_cause(r, None) == "`assert res.status_code == 400`: assert 200 == 400"
    assert pt.failure_cause(rec("error", message="TimeoutError: x"), None) == "TimeoutError: x"


def test_causes_shared_by_several_failures_are_counted() -> None:
    line = 'assert body["fp"].startswith("b")'
    orin = [rec("failed", id=i, line=line, message="assert False") for i in ("x", "y")]
    llama = [rec("passed", id=i) for i in ("x", "y")]
    md = pt.render_markdown(pt.build_report({pt.ORIN: orin, pt.LLAMA: llama}, {}))
    assert f"| `{line}` | 2 |" in md
