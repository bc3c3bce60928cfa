"""Pulling from a hub stand-in on loopback: selection, checksums, resume, the models
directory and a profile's ``hf:`` model. Nothing leaves 127.0.0.1."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from orin.cli.app import app
from orin.cli.deps import Deps
from orin.errors import HubError, ModelFileError, ProfileError
from orin.model import hub, store
from orin.model.gguf import read_model_info
from orin.profile.loader import parse_profile, resolve_model_path
from tests.fakes.runner import FakeRunner
from tests.ggufutil import LLAMA2_7B, write_gguf
from tests.unit.model.fakehub import COMMIT, FakeHub, point_at, serve

REPO = "acme/Tiny-GGUF"
Q4 = "Tiny-Q4_K_M.gguf"
Q8 = "Tiny-Q8_0.gguf"
MOSTLY_Q4_K_M, MOSTLY_Q8_0 = 15, 7


def gguf_bytes(tmp: Path, file_type: int, n: int = 4096) -> bytes:
    tensors = {"w": np.arange(n, dtype=np.float32)}
    path = write_gguf(tmp / f"src-{file_type}.gguf", params=LLAMA2_7B, file_type=file_type,
                      tensors=tensors)  # fmt: skip
    return path.read_bytes()


@pytest.fixture
def fake_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    src = tmp_path / "src"
    src.mkdir()
    repo = {
        Q4: gguf_bytes(src, MOSTLY_Q4_K_M),
        Q8: gguf_bytes(src, MOSTLY_Q8_0),
        "README.md": b"# Tiny\n",
    }
    with serve(FakeHub(repos={REPO: repo})) as h:
        point_at(h, monkeypatch, tmp_path / "hf-home")
        monkeypatch.setenv("ORIN_LLM_CACHE_DIR", str(tmp_path / "cache"))
        yield h


@pytest.fixture
def models(tmp_path: Path) -> Path:
    return tmp_path / "models"


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


# -- references and selection (pure) --


@pytest.mark.parametrize(
    ("spec", "repo", "file", "quant"),
    [
        ("acme/m", "acme/m", None, None),
        ("acme/m:m-Q4_K_M.gguf", "acme/m", "m-Q4_K_M.gguf", None),
        ("acme/m:sub/m.GGUF", "acme/m", "sub/m.GGUF", None),
        ("acme/m:Q4_K_M", "acme/m", None, "Q4_K_M"),
    ],
)
def test_parse_ref(spec: str, repo: str, file: str | None, quant: str | None) -> None:
    ref = store.parse_ref(spec)
    assert (ref.repo, ref.file, ref.quant, str(ref)) == (repo, file, quant, spec)


@pytest.mark.parametrize("spec", ["acme", "/abs:x.gguf", "acme/m:", "acme/m:../x.gguf", "a/../b"])
def test_parse_ref_refuses(spec: str) -> None:
    with pytest.raises(ValueError, match=r"owner/repo|not a file"):
        store.parse_ref(spec)


def test_quant_matches_whole_tokens_only() -> None:
    assert store.quant_matches("Llama-3-Q4_K_M.gguf", "q4_k_m")
    assert store.quant_matches("model.q8_0.gguf", "Q8_0")
    assert not store.quant_matches("Llama-Q4_K_M.gguf", "Q4_K")
    assert not store.quant_matches("m-Q4_0_4_4.gguf", "Q4_0")
    assert not store.quant_matches("m-IQ4_XS.gguf", "Q4_XS")


def test_pick_gguf_errors_list_the_candidates() -> None:
    names = ["a-Q4_K_M.gguf", "a-Q4_K_S.gguf", "a-Q8_0.gguf", "README.md"]
    assert store.pick_gguf(store.parse_ref("o/r:Q8_0"), names, "o/r") == "a-Q8_0.gguf"
    with pytest.raises(HubError, match=r"no GGUF file with Q5_K_M .*a-Q4_K_M.gguf, a-Q4_K_S"):
        store.pick_gguf(store.parse_ref("o/r:Q5_K_M"), names, "o/r")
    with pytest.raises(HubError, match=r"has 3 GGUF files: .*name one: o/r:FILE"):
        store.pick_gguf(store.parse_ref("o/r"), names, "o/r")
    with pytest.raises(HubError, match=r"has no file b\.gguf"):
        store.pick_gguf(store.parse_ref("o/r:b.gguf"), names, "o/r")


def test_a_quant_or_a_bare_repo_picks_the_model_beside_its_projector() -> None:
    """Q8_0 picked the model and mmproj-...-Q8_0.gguf alike: 'has 2 GGUF files'."""
    names = ["Vlm-Q8_0.gguf", "Vlm-f16.gguf", "mmproj-Vlm-Q8_0.gguf", "mmproj-Vlm-f16.gguf"]
    assert store.pick_gguf(store.parse_ref("o/r:Q8_0"), names, "o/r") == "Vlm-Q8_0.gguf"
    assert store.pick_gguf(store.parse_ref("o/r:F16"), names, "o/r") == "Vlm-f16.gguf"
    assert store.pick_gguf(store.parse_ref("o/r"), ["m.gguf", "sub/mmproj.gguf"], "o/r") == "m.gguf"
    only = ["mmproj-Vlm-f16.gguf", "Vlm-Q8_0.gguf"]
    assert store.pick_gguf(store.parse_ref("o/r:f16"), only, "o/r") == "mmproj-Vlm-f16.gguf"
    assert store.pick_gguf(store.parse_ref("o/r:mmproj"), only, "o/r") == "mmproj-Vlm-f16.gguf"
    with pytest.raises(HubError, match="has 2 GGUF files with mmproj in their names"):
        store.pick_gguf(store.parse_ref("o/r:mmproj"), names, "o/r")


def test_a_quant_split_into_parts_says_how_to_make_one_file() -> None:
    """It said 'has 3 GGUF files ...; name one', and a part named alone is no model."""
    parts = [f"Big-Q4_K_M-0000{n}-of-00003.gguf" for n in (1, 2, 3)]
    with pytest.raises(HubError) as caught:
        store.pick_gguf(store.parse_ref("o/r:Q4_K_M"), [*parts, "Big-Q8_0.gguf"], "o/r")
    message = str(caught.value)
    assert message.startswith(f"o/r has Q4_K_M split into 3 parts: {', '.join(parts)}; ")
    assert f"`llama-gguf-split --merge {parts[0]} Big-Q4_K_M.gguf`" in message
    assert "name one" not in message


# -- pull --


def test_pull_by_quant_checks_and_records(fake_hub: FakeHub, models: Path) -> None:
    result = hub.pull(store.parse_ref(f"{REPO}:q4_k_m"), models)
    assert result.downloaded and result.path == models / Q4 and result.revision == COMMIT
    assert result.path.read_bytes() == fake_hub.repos[REPO][Q4]
    assert read_model_info(result.path).quantization == "Q4_K_M"
    prov = store.read_provenance(models, Q4)
    assert prov is not None and (prov.repo, prov.path, prov.revision) == (REPO, Q4, COMMIT)
    assert prov.sha256 == fake_hub.sha256(REPO, Q4)
    assert files_under(models) == [f".hub/{Q4}.json", Q4]  # no partial left
    assert result.path.stat().st_mode & 0o777 == 0o644


def test_second_pull_downloads_nothing(fake_hub: FakeHub, models: Path) -> None:
    hub.pull(store.parse_ref(f"{REPO}:{Q8}"), models)
    gets = len(fake_hub.gets())
    again = hub.pull(store.parse_ref(f"{REPO}:Q8_0"), models)
    assert not again.downloaded and len(fake_hub.gets()) == gets


def test_checksum_mismatch_is_refused_and_nothing_stays(fake_hub: FakeHub, models: Path) -> None:
    fake_hub.sha_override[f"{REPO}/{Q4}"] = "0" * 64
    with pytest.raises(HubError, match=r"SHA-256 .* but the hub says 0{64}: refused and deleted"):
        hub.pull(store.parse_ref(f"{REPO}:Q4_K_M"), models)
    assert files_under(models) == []


def test_a_listed_file_the_hub_will_not_send_is_named(fake_hub: FakeHub, models: Path) -> None:
    fake_hub.gone.add(f"{REPO}/{Q4}")
    with pytest.raises(HubError) as caught:
        hub.pull(store.parse_ref(f"{REPO}:Q4_K_M"), models)
    assert f"HTTP 404 for {REPO}/{Q4}" in str(caught.value)


def test_a_server_announcing_another_size_is_refused_before_downloading(
    fake_hub: FakeHub, models: Path
) -> None:
    """It was downloaded, failed huggingface_hub's size check ("retry with
    force_download=True"), and every pull again 'resumed' into the same failure."""
    size = len(fake_hub.repos[REPO][Q4])
    fake_hub.size_override[f"{REPO}/{Q4}"] = size + 1000
    with pytest.raises(HubError) as caught:
        hub.pull(store.parse_ref(f"{REPO}:Q4_K_M"), models)
    assert str(caught.value) == (
        f"{fake_hub.url} announces {size + 1000:,} bytes for {REPO}/{Q4}, but the hub's file "
        f"list gives {size:,} with its SHA-256: the server (a mirror or a proxy) has another "
        "file; not downloading it (check HF_ENDPOINT)"
    )
    assert fake_hub.gets() == [] and files_under(models) == []


def test_a_body_cut_short_by_a_proxy_is_deleted_not_resumed(
    fake_hub: FakeHub, models: Path
) -> None:
    size = len(fake_hub.repos[REPO][Q4])
    fake_hub.short_body = 1000
    with pytest.raises(HubError) as caught:
        hub.pull(store.parse_ref(f"{REPO}:Q4_K_M"), models)
    message = str(caught.value)
    assert message.startswith(f"{fake_hub.url} sent 1,000 bytes of {REPO}/{Q4}, which has {size:,}")
    assert "partial download is deleted" in message and "force_download" not in message
    assert files_under(models) == []
    fake_hub.short_body = None
    again = hub.pull(store.parse_ref(f"{REPO}:Q4_K_M"), models)
    assert again.resumed_from == 0 and again.path.read_bytes() == fake_hub.repos[REPO][Q4]


def test_cli_a_revision_the_hub_does_not_know_is_named(fake_hub: FakeHub, models: Path) -> None:
    code, out, err = cli(
        "model", "pull", f"{REPO}:Q4_K_M", "--dir", str(models), "--revision", "v9"
    )
    assert (code, out) == (9, "")
    assert err == (
        f"orin-llm: {REPO} on {fake_hub.url} has no revision 'v9' (a branch, tag or commit of "
        "the repository); leave --revision out for main\n"
    )
    assert not models.exists()
    assert hub.pull(store.parse_ref(f"{REPO}:Q4_K_M"), models, revision=COMMIT).downloaded


def test_cli_a_login_page_instead_of_the_hub_is_named(fake_hub: FakeHub, models: Path) -> None:
    """It said 'JSONDecodeError: Expecting value: line 1 column 1 (char 0)'."""
    fake_hub.portal = True
    code, out, err = cli("model", "pull", f"{REPO}:Q4_K_M", "--dir", str(models))
    assert (code, out) == (9, "")
    assert err == (
        f"orin-llm: {fake_hub.url} did not answer for {REPO} as a Hugging Face Hub does (not "
        "JSON: a network's login page, or a proxy); check the network, or HF_ENDPOINT\n"
    )
    assert not models.exists()


def test_cli_a_redirect_loop_is_named(fake_hub: FakeHub, models: Path) -> None:
    """It said '{repo} on {hub}: TooManyRedirects: ...', as for an unknown failure."""
    fake_hub.loop = True
    code, out, err = cli("model", "pull", f"{REPO}:Q4_K_M", "--dir", str(models))
    assert (code, out) == (9, "")
    assert err.startswith(f"orin-llm: {fake_hub.url} redirected the request for {REPO}/{Q4} ")
    assert err.endswith("a mirror or proxy set up wrong; check HF_ENDPOINT\n")
    assert not (models / Q4).exists()


def test_quant_selection_errors(fake_hub: FakeHub, models: Path) -> None:
    with pytest.raises(HubError, match=f"no GGUF file with Q5_K_M in its name; .*{Q4}, {Q8}"):
        hub.pull(store.parse_ref(f"{REPO}:Q5_K_M"), models)
    with pytest.raises(HubError, match=f"has 2 GGUF files: {Q4}, {Q8}"):
        hub.pull(store.parse_ref(REPO), models)
    assert not models.exists() or files_under(models) == []


@pytest.mark.parametrize(
    ("status", "token", "says"),
    [
        (401, None, "answered HTTP 401 (unauthorized) for {file}: a private or gated "
                    "repository needs HF_TOKEN"),
        (401, "hf_wrong", "answered HTTP 401 (unauthorized) for {file}: HF_TOKEN is not a "
                          "valid token"),
        (403, "hf_other", "answered HTTP 403 (forbidden) for {file}: the account of HF_TOKEN "
                          "has no access"),
    ],
)  # fmt: skip
def test_a_refused_download_says_what_the_token_has_to_do_with_it(
    fake_hub: FakeHub,
    models: Path,
    monkeypatch: pytest.MonkeyPatch,
    status: int,
    token: str | None,
    says: str,
) -> None:
    if token is not None:
        monkeypatch.setenv("HF_TOKEN", token)
    fake_hub.refuse[REPO] = status
    with pytest.raises(HubError) as caught:
        hub.pull(store.parse_ref(f"{REPO}:Q4_K_M"), models)
    assert says.format(file=f"{REPO}/{Q4}") in str(caught.value)
    assert not models.exists() or files_under(models) == []


def test_a_repository_without_gguf_files_says_so_once(fake_hub: FakeHub, models: Path) -> None:
    fake_hub.repos["acme/Docs"] = {"README.md": b"# no weights here\n"}
    for spec in ("acme/Docs", "acme/Docs:Q4_K_M"):
        with pytest.raises(HubError) as caught:
            hub.pull(store.parse_ref(spec), models)
        assert str(caught.value).endswith(
            "acme/Docs on " + fake_hub.url + " has no GGUF file at all; orin-llm serves GGUF models"
        )


def test_unknown_repo_and_file_without_sha(fake_hub: FakeHub, models: Path) -> None:
    with pytest.raises(HubError, match=r"no model repository acme/none on http://127\.0\.0\.1"):
        hub.pull(store.parse_ref("acme/none:Q4_K_M"), models)
    fake_hub.no_lfs.add(f"{REPO}/{Q8}")
    with pytest.raises(HubError, match="has no SHA-256 in the hub's metadata"):
        hub.pull(store.parse_ref(f"{REPO}:Q8_0"), models)


def test_offline_names_the_endpoint(
    models: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    point_at(FakeHub(url=f"http://127.0.0.1:{port}"), monkeypatch, tmp_path / "hf-home")
    with pytest.raises(
        HubError, match=f"cannot reach the Hugging Face Hub at http://127.0.0.1:{port}"
    ):
        hub.pull(store.parse_ref(f"{REPO}:Q4_K_M"), models)


def test_another_file_of_the_same_name_is_not_replaced(fake_hub: FakeHub, models: Path) -> None:
    models.mkdir()
    (models / Q4).write_bytes(b"something else")
    with pytest.raises(HubError, match="already exists \\(not pulled from the hub\\)"):
        hub.pull(store.parse_ref(f"{REPO}:Q4_K_M"), models)
    assert (models / Q4).read_bytes() == b"something else"
    assert hub.pull(store.parse_ref(f"{REPO}:Q4_K_M"), models, force=True).downloaded


def test_a_folder_of_the_files_name_is_refused_before_downloading(
    fake_hub: FakeHub, models: Path
) -> None:
    """os.replace cannot put the file there: that was an internal error (exit 70) after
    the whole download."""
    (models / Q4).mkdir(parents=True)
    with pytest.raises(HubError, match=f"{Q4} is a folder or another non-file; move it away"):
        hub.pull(store.parse_ref(f"{REPO}:Q4_K_M"), models, force=True)
    assert fake_hub.gets() == [] and (models / Q4).is_dir()


def test_a_file_fetched_by_hand_is_adopted(fake_hub: FakeHub, models: Path) -> None:
    models.mkdir()
    (models / Q4).write_bytes(fake_hub.repos[REPO][Q4])
    result = hub.pull(store.parse_ref(f"{REPO}:Q4_K_M"), models)
    assert not result.downloaded and fake_hub.gets() == []
    assert store.read_provenance(models, Q4) is not None


def test_chown_gets_the_file_and_its_record(fake_hub: FakeHub, models: Path) -> None:
    given: list[Path] = []
    hub.pull(store.parse_ref(f"{REPO}:Q4_K_M"), models, chown=given.append)
    assert given == [models / Q4, models / ".hub", models / ".hub" / f"{Q4}.json"]


def test_progress_sees_every_byte(fake_hub: FakeHub, models: Path) -> None:
    seen: list[tuple[str, int | None, int]] = []
    done: list[int] = []

    class Bar:
        def __init__(self, desc: str, total: int | None, initial: int) -> None:
            seen.append((desc, total, initial))

        def update(self, n: int) -> None:
            done.append(n)

        def close(self) -> None:
            pass

    hub.pull(store.parse_ref(f"{REPO}:Q8_0"), models, progress=Bar)
    size = len(fake_hub.repos[REPO][Q8])
    assert seen == [(Q8, size, 0)] and sum(done) == size


# -- the models directory and profiles --


def test_profile_hf_model_resolves_after_pull_only(fake_hub: FakeHub, tmp_path: Path) -> None:
    cache_models = tmp_path / "cache" / "models"
    profile = parse_profile(f"name: t\nmodel: {{hf: '{REPO}:Q4_K_M'}}\n")
    with pytest.raises(ModelFileError, match=f"run `orin-llm model pull {REPO}:Q4_K_M`"):
        resolve_model_path(profile)
    hub.pull(store.parse_ref(f"{REPO}:Q4_K_M"), cache_models)
    assert resolve_model_path(profile) == cache_models / Q4
    by_file = parse_profile(f"name: t\nmodel: {{hf: '{REPO}:{Q4}'}}\n")
    assert resolve_model_path(by_file) == cache_models / Q4
    gets = len(fake_hub.gets())
    other = parse_profile(f"name: t\nmodel: {{hf: '{REPO}:Q8_0'}}\n")
    with pytest.raises(ModelFileError, match="not pulled yet"):
        resolve_model_path(other)  # never downloads at serve time
    assert len(fake_hub.gets()) == gets


def test_profile_hf_format_is_checked() -> None:
    with pytest.raises(ProfileError, match=r"<profile>:2: model.hf: .*owner/repo"):
        parse_profile("name: t\nmodel: {hf: 'no-slash'}\n")


def test_remove_stays_inside(tmp_path: Path, models: Path) -> None:
    models.mkdir()
    card = tmp_path / "card"
    card.mkdir()
    outside = card / "outside.gguf"
    outside.write_bytes(b"x")
    (models / "card").symlink_to(card)
    with pytest.raises(ModelFileError, match="not inside the models directory"):
        store.remove(models, models / "card" / "outside.gguf")  # through a linked folder
    with pytest.raises(ModelFileError, match="not inside"):
        store.remove(models, models / ".." / "card" / "outside.gguf")
    with pytest.raises(ModelFileError, match="not inside"):
        store.remove(models, models / "card" / "..")
    assert outside.exists()


def test_remove_takes_a_link_away_and_leaves_its_target(tmp_path: Path, models: Path) -> None:
    """A model linked in from an SD card was refused as outside the models directory."""
    models.mkdir()
    outside = tmp_path / "outside.gguf"
    outside.write_bytes(b"x")
    (models / "link.gguf").symlink_to(outside)
    (models / "gone.gguf").symlink_to(tmp_path / "unmounted.gguf")
    assert store.remove(models, models / "link.gguf") == [models / "link.gguf"]
    assert store.remove(models, models / "gone.gguf") == [models / "gone.gguf"]
    assert outside.read_bytes() == b"x" and list(models.iterdir()) == []


# -- the CLI: pull, list, rm --


def cli(
    *args: str, uid: int = 1000, runner: FakeRunner | None = None, input: str | None = None
) -> tuple[int, str, str]:
    deps = Deps(runner=runner or FakeRunner(), effective_uid=lambda: uid)
    r = CliRunner().invoke(app, list(args), env={"COLUMNS": "250"}, obj=deps, input=input)
    return r.exit_code, r.stdout, r.stderr


def test_cli_pull_list_rm(fake_hub: FakeHub, models: Path, tmp_path: Path) -> None:
    code, out, err = cli("model", "pull", f"{REPO}:Q4_K_M", "--dir", str(models), "--json")
    assert code == 0, err
    assert json.loads(out)["path"] == str(models / Q4)
    profile = tmp_path / "mine.yaml"
    profile.write_text(f"name: mine\nmodel:\n  hf: {REPO}:Q4_K_M\n")
    write_gguf(models / "other.gguf", params=LLAMA2_7B, file_type=MOSTLY_Q8_0)

    code, out, err = cli("model", "list", "--dir", str(models), "--profile", str(profile), "--json")
    assert code == 0, err
    listed = {m["name"]: m for m in json.loads(out)["models"]}
    assert listed[Q4]["quantization"] == "Q4_K_M" and listed[Q4]["source"] == f"hf:{REPO}:{Q4}"
    assert listed[Q4]["used_by"] == [str(profile)]
    assert listed["other.gguf"]["quantization"] == "Q8_0" and listed["other.gguf"]["used_by"] == []
    code, out, _ = cli("model", "list", "--dir", str(models))
    assert code == 0 and Q4 in out and "Q4_K_M" in out

    code, _, err = cli("model", "rm", Q4, "--dir", str(models), "--profile", str(profile), "--yes")
    assert code == 1 and "is the model of profile" in err and (models / Q4).exists()
    code, _, _ = cli("model", "rm", Q4, "--dir", str(models), input="n\n")
    assert code == 1 and (models / Q4).exists()  # not confirmed
    code, out, err = cli("model", "rm", "../mine.yaml", "--dir", str(models), "--yes")
    assert code == 3 and "not inside the models directory" in err and profile.exists()
    code, out, err = cli("model", "rm", Q4, "--dir", str(models), input="y\n")
    assert code == 0, err
    assert not (models / Q4).exists() and not store.meta_path(models, Q4).exists()
    assert files_under(models) == ["other.gguf"]


def test_cli_rm_in_a_models_directory_that_does_not_exist_says_so(tmp_path: Path) -> None:
    """A mistyped --dir: the folder is named as missing, not listed as holding no model."""
    missing = tmp_path / "modles"
    code, _, err = cli("model", "rm", "x.gguf", "--dir", str(missing), "--yes")
    assert code == 3
    assert f"no model x.gguf: the models directory {missing} does not exist" in err


def test_cli_rm_a_linked_model_removes_the_link_only(tmp_path: Path, models: Path) -> None:
    card = tmp_path / "card"
    card.mkdir()
    target = write_gguf(card / "big.gguf", params=LLAMA2_7B, file_type=MOSTLY_Q8_0)
    models.mkdir()
    (models / "big.gguf").symlink_to(target)
    (models / "card").symlink_to(card)
    code, out, err = cli("model", "rm", "card/big.gguf", "--dir", str(models), "--yes")
    assert code == 3 and "not inside the models directory" in err and target.exists()
    code, out, err = cli("model", "rm", "big.gguf", "--dir", str(models), input="y\n")
    assert code == 0, err
    assert f"delete the link {models / 'big.gguf'} (to {target}, which stays)?" in out
    assert f"removed the link {models / 'big.gguf'} ({target} stays)" in out
    assert not (models / "big.gguf").is_symlink() and target.is_file()


def test_cli_rm_a_link_is_refused_only_for_a_profile_that_names_the_link(
    tmp_path: Path, models: Path
) -> None:
    """A profile serving the card's file by its own path loses nothing when the link
    goes; rm refused it as "the service would not start without it"."""
    card = write_gguf(tmp_path / "card-big.gguf", params=LLAMA2_7B, file_type=MOSTLY_Q8_0)
    models.mkdir()
    link = models / "big.gguf"
    link.symlink_to(card)
    direct, via_link = tmp_path / "direct.yaml", tmp_path / "via-link.yaml"
    direct.write_text(f"name: direct\nmodel: {{path: {card}}}\n")
    via_link.write_text(f"name: via-link\nmodel: {{path: {link}}}\n")
    rm = ("model", "rm", "big.gguf", "--dir", str(models), "--yes")
    code, _, err = cli(*rm, "--profile", str(via_link))
    assert code == 1 and "is the model of profile" in err and link.is_symlink()
    code, _, err = cli(*rm, "--profile", str(direct))
    assert code == 0, err
    assert not link.is_symlink() and card.is_file()


def test_cli_rm_refuses_the_projector_and_draft_model_a_profile_in_use_names(
    tmp_path: Path, models: Path
) -> None:
    """Only model.path counted: the projector and the draft model of the service's
    profile were deleted without a word, and list showed them used by nobody."""
    models.mkdir()
    for name in ("m.gguf", "mm.gguf", "d.gguf"):
        write_gguf(models / name, params=LLAMA2_7B, file_type=MOSTLY_Q8_0)
    profile = tmp_path / "vis.yaml"
    profile.write_text(
        f"name: vis\nmodel: {{path: {models / 'm.gguf'}, mmproj: mm.gguf}}\n"
        f"speculative: {{mode: draft, draft_model: {models / 'd.gguf'}}}\n"
    )
    (tmp_path / "mm.gguf").symlink_to(models / "mm.gguf")  # relative to the profile's folder
    code, out, err = cli("model", "list", "--dir", str(models), "--profile", str(profile), "--json")
    used = {m["name"]: m["used_by"] for m in json.loads(out)["models"]}
    assert used == {
        "d.gguf": [f"{profile} (speculative.draft_model)"],
        "m.gguf": [str(profile)],
        "mm.gguf": [f"{profile} (model.mmproj)"],
    }
    rm = ("model", "rm", "--dir", str(models), "--yes", "--profile", str(profile))
    code, _, err = cli(*rm[:2], "mm.gguf", *rm[2:])
    assert code == 1 and (models / "mm.gguf").is_file()
    assert err == (
        f"orin-llm: mm.gguf is model.mmproj of profile {profile}: the service would not start "
        "without it; use --force to delete it anyway\n"
    )
    code, _, err = cli(*rm[:2], "d.gguf", *rm[2:])
    assert code == 1 and "d.gguf is speculative.draft_model of profile" in err
    assert (models / "d.gguf").is_file()
    code, _, err = cli(*rm[:2], "d.gguf", *rm[2:], "--force")
    assert code == 0 and not (models / "d.gguf").exists()


def test_cli_rm_a_file_the_user_may_not_delete_is_one_line(
    models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user's rm in the service's folder was 'internal error: PermissionError', exit 70."""
    models.mkdir()
    model = write_gguf(models / "m.gguf", params=LLAMA2_7B)
    unlink = Path.unlink

    def denied(self: Path, missing_ok: bool = False) -> None:
        if self == model:  # a folder of root's, for a user
            raise PermissionError(13, "Permission denied", str(self))
        unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", denied)
    code, out, err = cli("model", "rm", "m.gguf", "--dir", str(models), "--yes")
    assert (code, out) == (1, "")
    assert err == (
        f"orin-llm: cannot delete {model}: Permission denied (a folder root owns, as the "
        "service's, needs sudo)\n"
    )
    assert model.is_file()


def test_cli_list_shows_a_link_whose_file_is_not_there(tmp_path: Path, models: Path) -> None:
    """A model linked in from a card that is not mounted was left out of model list,
    so the user could not see the name to give model rm."""
    models.mkdir()
    card = write_gguf(tmp_path / "card.gguf", params=LLAMA2_7B, file_type=MOSTLY_Q8_0)
    (models / "here.gguf").symlink_to(card)
    (models / "gone.gguf").symlink_to(tmp_path / "unmounted" / "gone.gguf")
    (models / "loop.gguf").symlink_to("loop.gguf")
    code, out, err = cli("model", "list", "--dir", str(models), "--json")
    assert code == 0, err
    listed = {m["name"]: m for m in json.loads(out)["models"]}
    assert listed["loop.gguf"]["link_to"] == "loop.gguf" and listed["loop.gguf"]["size"] is None
    assert listed["here.gguf"]["link_to"] == str(card) and listed["here.gguf"]["size"] > 0
    gone = listed["gone.gguf"]
    assert gone["size"] is None and gone["quantization"] is None
    assert gone["link_to"] == str(tmp_path / "unmounted" / "gone.gguf")
    assert "which is not there" in gone["problem"]
    code, out, _ = cli("model", "list", "--dir", str(models))
    assert code == 0 and "gone.gguf" in out and "which is not there" in out
    for name in ("gone.gguf", "loop.gguf"):
        code, out, err = cli("model", "rm", name, "--dir", str(models), "--yes")
        assert code == 0, err
    assert sorted(p.name for p in models.iterdir()) == ["here.gguf"]


def test_cli_corrupted_pull_exits_9(fake_hub: FakeHub, models: Path) -> None:
    fake_hub.sha_override[f"{REPO}/{Q8}"] = "f" * 64
    code, out, err = cli("model", "pull", f"{REPO}:Q8_0", "--dir", str(models))
    assert code == 9 and out == ""
    assert err.startswith("orin-llm: ") and "refused and deleted" in err
    assert files_under(models) == []


def test_cli_ctrl_c_says_what_is_kept_and_the_next_pull_resumes_there(
    fake_hub: FakeHub, models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C ended the pull with exit 130 and not a word about the part file."""
    size = len(fake_hub.repos[REPO][Q8])
    check = hub.sha256_file

    def ctrl_c(path: Path) -> str:
        monkeypatch.setattr(hub, "sha256_file", check)
        raise KeyboardInterrupt  # while the downloaded file is checked

    monkeypatch.setattr(hub, "sha256_file", ctrl_c)
    code, out, err = cli("model", "pull", f"{REPO}:Q8_0", "--dir", str(models))
    part = models / store.PARTIAL_DIR / f"{Q8}.{fake_hub.sha256(REPO, Q8)[:16]}.part"
    assert (code, out) == (130, "")
    kib = f"{size / 1024:.2f} KiB"
    assert err == (
        f"orin-llm: interrupted: {kib} of {kib} of {REPO}/{Q8} kept in {part}; "
        "run the same pull again to resume\n"
    )
    assert files_under(models) == [str(part.relative_to(models))]
    gets = len(fake_hub.gets())
    again = hub.pull(store.parse_ref(f"{REPO}:Q8_0"), models)
    assert again.resumed_from == size and len(fake_hub.gets()) == gets
    assert again.path.read_bytes() == fake_hub.repos[REPO][Q8]


def test_ctrl_c_during_the_download_names_the_bytes_it_keeps(
    fake_hub: FakeHub, models: Path
) -> None:
    data = fake_hub.repos[REPO][Q4]
    part = models / store.PARTIAL_DIR / f"{Q4}.{fake_hub.sha256(REPO, Q4)[:16]}.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(data[:1000])  # an earlier pull's

    class CtrlC:
        def update(self, n: int) -> None:
            raise KeyboardInterrupt

        def close(self) -> None:
            pass

    with pytest.raises(hub.PullInterrupted) as caught:
        hub.pull(store.parse_ref(f"{REPO}:Q4_K_M"), models, progress=lambda *_: CtrlC())
    assert (caught.value.have, caught.value.size, caught.value.part) == (1000, len(data), part)
    assert part.read_bytes() == data[:1000]


def test_a_part_of_an_earlier_version_is_deleted_before_the_disk_is_asked(
    fake_hub: FakeHub, models: Path
) -> None:
    """A part of a file since changed on the hub stayed in .partial for good, its
    space counted against the new download."""
    partial = models / store.PARTIAL_DIR
    partial.mkdir(parents=True)
    old = partial / f"{Q8}.{'a' * 16}.part"
    old.write_bytes(b"x" * 5000)
    other = partial / f"{Q4}.{'a' * 16}.part"  # another file's: kept
    other.write_bytes(b"y")
    size = len(fake_hub.repos[REPO][Q8])
    seen: list[list[str]] = []

    def free(folder: Path) -> int:
        seen.append(sorted(p.name for p in folder.iterdir()))
        return size

    hub.pull(store.parse_ref(f"{REPO}:Q8_0"), models, disk_free=free)
    assert seen == [[other.name]]
    assert not old.exists() and other.read_bytes() == b"y"


def test_a_file_the_disk_cannot_hold_is_refused_before_a_byte_is_fetched(
    fake_hub: FakeHub, models: Path
) -> None:
    """It was fetched until the disk was full, leaving a part file that kept it full."""
    size = len(fake_hub.repos[REPO][Q8])
    asked: list[Path] = []

    def free(folder: Path) -> int:
        asked.append(folder)
        return size - 1

    with pytest.raises(HubError, match=f"{REPO}/{Q8} needs 0.00 GiB more, and the filesystem"):
        hub.pull(store.parse_ref(f"{REPO}:Q8_0"), models, disk_free=free)
    assert asked == [models / store.PARTIAL_DIR] and fake_hub.gets() == []
    assert files_under(models) == [] and not (models / store.PARTIAL_DIR).exists()
    assert hub.pull(store.parse_ref(f"{REPO}:Q8_0"), models, disk_free=lambda _: size).downloaded


def test_cli_pull_asks_the_disk_it_writes_to(fake_hub: FakeHub, models: Path) -> None:
    deps = Deps(runner=FakeRunner(), effective_uid=lambda: 1000, disk_free=lambda _: 0)
    r = CliRunner().invoke(app, ["model", "pull", f"{REPO}:Q8_0", "--dir", str(models)], obj=deps)
    assert r.exit_code == 9 and "or pull into a folder on another disk with --dir" in r.stderr


def test_cli_bad_reference_is_a_usage_error(fake_hub: FakeHub) -> None:
    code, _, err = cli("model", "pull", "not-a-repo")
    assert code == 2 and "owner/repo" in err
    code, _, err = cli("model", "pull")  # named as the docs write it, not 'spec'
    assert code == 2 and "Missing argument 'OWNER/REPO[:FILE|:QUANT]'" in err


def test_cli_root_pulls_into_the_service_directory_for_its_user(
    fake_hub: FakeHub, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    runner = FakeRunner(programs={"getent", "chown"})
    code, _, err = cli("model", "pull", f"{REPO}:Q4_K_M", "--root", str(root), uid=0,
                       runner=runner)  # fmt: skip
    assert code == 0, err
    target = root / "var/lib/orin-llm/models" / Q4
    assert target.is_file()
    assert ("chown", "-h", "orin-llm:", str(target)) in runner.calls


def test_a_pull_writes_through_no_link_planted_in_the_models_folder(
    fake_hub: FakeHub, tmp_path: Path
) -> None:
    """Root pulls into the service's folder, whose .hub and .partial the service user
    may write: links planted at the names a pull writes are replaced, not followed."""
    models = tmp_path / "models"
    victim = tmp_path / "shadow"
    victim.write_text("root:secret\n")
    part = models / ".partial" / f"{Q4}.{fake_hub.sha256(REPO, Q4)[:16]}.part"
    for planted in (models / ".hub" / f"{Q4}.json.tmp", part):
        planted.parent.mkdir(parents=True, exist_ok=True)
        planted.symlink_to(victim)
    code, _, err = cli("model", "pull", f"{REPO}:Q4_K_M", "--dir", str(models))
    assert code == 0, err
    assert victim.read_text() == "root:secret\n"
    assert not (models / ".hub" / f"{Q4}.json").is_symlink()


# -- doctor --


def test_doctor_names_the_pull_for_an_unpulled_model(fake_hub: FakeHub, tmp_path: Path) -> None:
    from orin.doctor.checks import check_model_file
    from orin.doctor.context import DoctorContext, model_path_for
    from orin.system.root import SysRoot

    profile = parse_profile(f"name: t\nmodel: {{hf: '{REPO}:Q4_K_M'}}\n")
    path, source = model_path_for(profile, None)
    assert (path, source) == (None, "hf")
    ctx = DoctorContext(SysRoot(tmp_path), FakeRunner(), profile, path, source)
    f = check_model_file(ctx)
    assert f.severity == "fail" and "not pulled yet" in f.found
    assert f.fix == f"orin-llm model pull {REPO}:Q4_K_M"

    hub.pull(store.parse_ref(f"{REPO}:Q4_K_M"), tmp_path / "cache" / "models")
    path, source = model_path_for(profile, None)
    assert path == tmp_path / "cache" / "models" / Q4 and source == "hf"
    ok = check_model_file(DoctorContext(SysRoot(tmp_path), FakeRunner(), profile, path, source))
    assert ok.severity == "ok" and "Q4_K_M" in ok.found
