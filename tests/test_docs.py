"""The documentation: the MkDocs site builds in strict mode, the README stays a short guide, the numbers and scheme
tables agree with the registries, snippets run as written and every cited docs page and section exists."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300


def test_mkdocs_build_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"


# the file names of the project's internal planning specs, which the repository never cites: its docs are the reference
INTERNAL_SPEC = re.compile(r"SCHEMES(?:_WAVE\d+)?\.md|REFERENCE_RESULTS\.md")


def _repository_text_files() -> list[Path]:
    folders = ("docs", "visionpe", "tests", "train", "bench", "configs", "scripts", "assets")
    files = [ROOT / "README.md", ROOT / "mkdocs.yml", ROOT / "pyproject.toml"]
    for folder in folders:
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in {".py", ".md", ".yaml", ".sh", ".txt"}]
    return files


def test_no_file_cites_internal_specs():
    offending = [
        str(p.relative_to(ROOT))
        for p in _repository_text_files()
        if INTERNAL_SPEC.search(p.read_text(encoding="utf-8"))
    ]
    assert not offending, f"these files cite an internal spec: {offending}"


# --- the numbers and names the docs state, against the registries ------------------------------------------------

NUMBER_WORDS = {
    word: value
    for value, word in enumerate(
        "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen "
        "eighteen nineteen twenty".split(),
        start=1,
    )
}
# "29 vision schemes", "**5 camera-aware schemes**", "15 multimodal position designs", "four VLM families"
COUNT = re.compile(
    r"\b(\d+|" + "|".join(NUMBER_WORDS) + r")\s+"
    r"(vision schemes|camera-aware schemes|multimodal (?:position )?designs|(?:VLM |model )families)\b",
    re.IGNORECASE,
)


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _families() -> set[str]:
    """The supported VLM families, one per inner model class with its version removed: Qwen2VLModel, Qwen2_5_VLModel
    and Qwen3VLModel are "qwenvl", LlavaOnevisionModel is "llavaonevision" (the docs' "LLaVA-OneVision")."""
    hf = pytest.importorskip("visionpe.integrations.hf")
    return {re.sub(r"[^a-z]", "", name.removesuffix("Model").lower()) for name in hf.SUPPORTED_MODELS}


def _registry_counts() -> dict[str, int]:
    counts = {
        "vision schemes": len(_library_schemes()),
        "camera-aware schemes": len(_library_schemes("camera")),
        "multimodal designs": len(_library_designs()),
    }
    try:
        import visionpe.integrations.hf  # noqa: F401  (the vlm extra: the families are its adapters' classes)
    except ImportError:
        return counts
    return {**counts, "families": len(_families())}


def _stated_counts(text: str) -> list[tuple[str, int, str]]:
    """(what, number, the words as written) for every count the text states."""
    text = text.replace("**", "")
    found = []
    for match in COUNT.finditer(text):
        number, what = match.groups()
        value = int(number) if number.isdigit() else NUMBER_WORDS[number.lower()]
        what = re.sub(r"multimodal position designs", "multimodal designs", what.lower())
        found.append(("families" if what.endswith("families") else what, value, match.group(0)))
    return found


def test_counts_in_the_docs_are_the_registrys():
    # README.md and docs/index.md state the three counts; a scheme registered without updating them fails here
    counts = _registry_counts()
    wrong = []
    for path in _documents():
        stated = _stated_counts(path.read_text(encoding="utf-8"))
        if path in (ROOT / "README.md", ROOT / "docs" / "index.md"):
            missing = {"vision schemes", "camera-aware schemes", "multimodal designs"} - {w for w, _, _ in stated}
            assert not missing, f"{path.relative_to(ROOT)} no longer states the number of {sorted(missing)}"
        wrong += [
            f"{path.relative_to(ROOT)}: {words!r}, registered: {counts[what]}"
            for what, n, words in stated
            if what in counts and n != counts[what]
        ]
    assert not wrong, "counts that differ from the registries:\n" + "\n".join(wrong)


def _paragraph_with(text: str, pattern: str) -> str:
    """The list item or paragraph of ``text`` in which ``pattern`` matches (the line and its continuation lines)."""
    blocks = re.split(r"\n(?=\s*\n|- |\* |\| )", text)
    matches = [b for b in blocks if re.search(pattern, b.replace("**", ""))]
    assert matches, f"no paragraph matches {pattern!r}"
    return matches[0]


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_the_multimodal_summary_names_every_supported_vlm_family(page):
    summary = _paragraph_with((ROOT / page).read_text(encoding="utf-8"), r"\d+ multimodal (?:position )?designs")
    named = {re.sub(r"[^a-z]", "", word.lower()) for word in re.findall(r"[A-Za-z][\w.-]*", summary)}
    missing = _families() - named
    assert not missing, f"{page}'s summary of the multimodal designs does not name the families {sorted(missing)}"


def test_the_hf_vlms_page_lists_every_supported_model_class():
    hf = pytest.importorskip("visionpe.integrations.hf")
    from visionpe.integrations.hf.llava import outer_name

    text = (ROOT / "docs" / "hf_vlms.md").read_text(encoding="utf-8")
    missing = [outer_name(name) for name in hf.SUPPORTED_MODELS if f"`{outer_name(name)}`" not in text]
    assert not missing, f"docs/hf_vlms.md does not list {missing}"


def _split_row(line: str) -> list[str]:
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip()[1:-1])]


def _table(path: str, header: tuple[str, ...]) -> list[list[str]]:
    """The body rows of the first table in ``path`` whose header begins with the cells ``header``."""
    lines = (ROOT / path).read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and tuple(_split_row(line)[: len(header)]) == header:
            rows = []
            for body in lines[i + 2 :]:
                if not body.startswith("|"):
                    break
                rows.append(_split_row(body))
            return rows
    raise AssertionError(f"{path} has no table with the header {header}")


def _names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _library_schemes(kind: str | None = None) -> list[str]:
    """``visionpe.list_schemes(kind)`` without the schemes a test registers for a while (their classes are defined
    outside the package)."""
    import visionpe
    from visionpe.registry import get_scheme_class

    return [n for n in visionpe.list_schemes(kind) if get_scheme_class(n).__module__.startswith("visionpe.")]


def _library_designs() -> list[str]:
    """``visionpe.multimodal.list_multimodal_schemes()`` without the designs a test registers for a while (their design
    functions are defined outside the package)."""
    from visionpe.multimodal import MULTIMODAL_SCHEMES, list_multimodal_schemes

    return [n for n in list_multimodal_schemes() if MULTIMODAL_SCHEMES[n].design.__module__.startswith("visionpe.")]


def _kinds() -> dict[str, str]:
    """Every registered vision and camera scheme -> its kind."""
    from visionpe.registry import get_scheme_class

    return {name: get_scheme_class(name).kind for name in _library_schemes() + _library_schemes("camera")}


def test_schemes_page_kinds_table_lists_every_registered_scheme():
    rows = _table("docs/schemes.md", ("kind", "base class"))
    listed = {row[0]: set(_names(row[3])) for row in rows}
    registered = {kind: set(_library_schemes(kind)) for kind in {_kinds()[n] for n in _library_schemes()}}
    differences = {
        kind: {
            "missing": sorted(registered.get(kind, set()) - listed.get(kind, set())),
            "not registered": sorted(listed.get(kind, set()) - registered.get(kind, set())),
        }
        for kind in set(listed) | set(registered)
        if listed.get(kind) != registered.get(kind)
    }
    assert not differences, f"docs/schemes.md's kinds table differs from the registry: {differences}"


def test_schemes_page_has_a_section_per_vision_scheme():
    headings = re.findall(r"^###? .*$", (ROOT / "docs" / "schemes.md").read_text(encoding="utf-8"), re.MULTILINE)
    in_headings = {name for heading in headings for name in _names(heading)}
    missing = sorted(set(_library_schemes()) - in_headings)
    assert not missing, f"docs/schemes.md has no section for {missing}"


def test_schemes_page_table_lists_every_scheme_with_its_kind():
    rows = _table("docs/schemes.md", ("name", "kind"))
    listed = {name: row[1] for row in rows for name in _names(row[0])}
    kinds = _kinds()
    other_kind = sorted(n for n in set(kinds) & set(listed) if listed[n] != kinds[n])
    assert listed == kinds, (
        f"docs/schemes.md's table at a glance: missing {sorted(set(kinds) - set(listed))}, not registered "
        f"{sorted(set(listed) - set(kinds))}, another kind than registered {other_kind}"
    )


def test_readme_summary_names_every_scheme_and_design_by_kind():
    # one row per kind: a new scheme lengthens a row, never the README
    listed = {row[0]: sorted(_names(row[2])) for row in _table("README.md", ("kind", "enters the model"))}
    registered = {kind: sorted(n for n, k in _kinds().items() if k == kind) for kind in set(_kinds().values())}
    registered["multimodal design"] = sorted(_library_designs())
    assert listed == registered, f"README.md's scheme summary {listed} differs from the registries {registered}"


@pytest.mark.parametrize(
    "path, header",
    [
        ("docs/multimodal.md", ("scheme", "design")),
        ("docs/schemes.md", ("scheme", "paper", "when to pick")),
    ],
)
def test_multimodal_tables_list_every_registered_design(path, header):
    listed = [name for row in _table(path, header) for name in _names(row[0])]
    registered = _library_designs()
    assert sorted(listed) == registered, (
        f"{path}, table {header}: missing {sorted(set(registered) - set(listed))}, not registered "
        f"{sorted(set(listed) - set(registered))}"
    )


# --- snippets that run from the repository root -----------------------------------------------------------------


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def _experiment_snippets() -> list[tuple[str, str]]:
    found = []
    for path in _documents():
        for block in _python_blocks(path.read_text(encoding="utf-8")):
            if re.search(r"^from experiments\b|^import experiments\b", block, re.MULTILINE):
                found.append((str(path.relative_to(ROOT)), block))
    return found


def test_docs_import_the_experiment_code_as_they_say():
    # train/experiments is not installed: a snippet that imports it says how (sys.path) and runs from the repository
    # root as written, up to and including its imports; the benchmark it then starts is replaced by a recorder
    snippets = _experiment_snippets()
    assert snippets, "no snippet imports train/experiments any more: drop this test"
    for page, block in snippets:
        lines = block.splitlines()
        last_import = max(i for i, line in enumerate(lines) if re.match(r"(from|import) experiments\b", line))
        head, rest = "\n".join(lines[: last_import + 1]), "\n".join(lines[last_import + 1 :])
        code = (
            "import experiments_recorder\n"
            f"exec(compile({head!r}, 'snippet', 'exec'))\n"
            "calls = experiments_recorder.record(globals())\n"
            f"exec(compile({rest!r}, 'snippet', 'exec'))\n"
            "print(calls)\n"
        )
        recorder = (
            "def record(namespace):\n"
            "    calls = []\n"
            "    for name in ('run_benchmark', 'train_and_evaluate'):\n"
            "        if name in namespace:\n"
            "            namespace[name] = lambda *args, _name=name, **kwargs: calls.append((_name, args, kwargs))\n"
            "    return calls\n"
        )
        with tempfile.TemporaryDirectory() as helper:
            Path(helper, "experiments_recorder.py").write_text(recorder, encoding="utf-8")
            env = {**os.environ, "PYTHONPATH": helper}
            result = subprocess.run(
                [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
            )
        assert result.returncode == 0, f"{page}:\n{block}\n{result.stderr}"
        assert "trainer_args" not in block or "'strategy'" in result.stdout, result.stdout


# --- citations of docs pages and their sections -----------------------------------------------------------------


class _AnyTagLoader(yaml.SafeLoader):
    """mkdocs.yml may hold !!python/name: and !ENV tags; only the plain settings are read here."""


_AnyTagLoader.add_multi_constructor("", lambda loader, suffix, node: None)


@functools.cache
def _anchors(page: Path) -> tuple[frozenset[str], frozenset[str]]:
    """(heading ids, heading texts) of a Markdown page, rendered with mkdocs.yml's extensions as MkDocs does."""
    import markdown

    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=_AnyTagLoader)
    extensions, configs = [], {}
    for entry in config.get("markdown_extensions", []):
        name, options = next(iter(entry.items())) if isinstance(entry, dict) else (entry, None)
        extensions.append(name)
        options = dict(options or {})
        if name == "pymdownx.snippets":
            options["base_path"] = [str(ROOT)]
        configs[name] = options
    md = markdown.Markdown(extensions=extensions, extension_configs=configs)
    md.convert(page.read_text(encoding="utf-8"))
    ids, names, stack = set(), set(), list(md.toc_tokens)
    while stack:
        token = stack.pop()
        ids.add(token["id"])
        names.add(re.sub(r"<[^>]+>|`", "", token["name"]).casefold())
        stack.extend(token["children"])
    return frozenset(ids), frozenset(names)


# docs/training.md, docs/training.md#the-vlm-benchmark-under-fsdp, docs/reliability.md, "Exporting at any image size"
CITATION = re.compile(
    r'(?<![\w./-])((?:docs/[\w./-]+?\.md)|README\.md)(?:#([\w-]+))?(?:,\s*(?:section\s+)?"([^"\n]+)")?'
)
# [text](page.md#anchor) inside docs/
LINK = re.compile(r"\]\(([\w./-]+?\.md)(?:#([\w-]+))?\)")


def _citing_files() -> list[Path]:
    files = [*_documents(), *sorted((ROOT / "configs").rglob("*.yaml"))]
    for folder in ("visionpe", "train", "bench", "tests", "scripts"):
        files += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in {".py", ".sh"})
    return [p for p in files if p.is_file() and p != Path(__file__).resolve()]  # this file quotes citation forms


def _check_citation(source: str, page: Path, anchor: str | None, section: str | None) -> str | None:
    if not page.is_file():
        return f"{source}: {page.relative_to(ROOT)} does not exist"
    ids, names = _anchors(page)
    if anchor is not None and anchor not in ids:
        return f"{source}: {page.relative_to(ROOT)} has no section #{anchor}"
    if section is not None and section.casefold() not in names:
        return f"{source}: {page.relative_to(ROOT)} has no section {section!r}"
    return None


def test_every_cited_docs_page_and_section_exists():
    broken = []
    for path in _citing_files():
        text = path.read_text(encoding="utf-8")
        source = str(path.relative_to(ROOT))
        if path.suffix == ".yaml":
            text = "\n".join(line.partition("#")[2] for line in text.splitlines() if line.lstrip().startswith("#"))
            # a config comment cites a page (and section) by path; "see the README's protocol study" cannot be checked
            broken += [
                f"{source}: a README citation without README.md#anchor" for _ in re.finditer(r"README(?!\.md#)", text)
            ]
        for match in CITATION.finditer(text):
            broken.append(_check_citation(source, ROOT / match.group(1), match.group(2), match.group(3)))
        if path.suffix == ".md" and path.is_relative_to(ROOT / "docs"):
            for match in LINK.finditer(text):
                target = (path.parent / match.group(1)).resolve()
                if target.is_relative_to(ROOT / "docs"):
                    broken.append(_check_citation(source, target, match.group(2), None))
    broken = [b for b in broken if b is not None]
    assert not broken, "broken citations:\n" + "\n".join(sorted(set(broken)))


def test_the_torch_pair_is_the_same_everywhere():
    # scripts/setup.sh pins the pair; the docs' install lines and the floors in pyproject.toml name the same versions
    pins = re.findall(r"pip install -q (torch==\S+ torchvision==\S+)", (ROOT / "scripts" / "setup.sh").read_text())
    assert len(pins) == 1, pins
    pair = pins[0]
    for page in ("README.md", "docs/installation.md"):
        stated = set(re.findall(r"pip install (torch==\S+ torchvision==\S+)", (ROOT / page).read_text()))
        assert stated == {pair}, f"{page} installs {stated}, scripts/setup.sh {pair}"
    floors = dict(re.findall(r'"(torch|torchvision)>=([\w.]+)"', (ROOT / "pyproject.toml").read_text()))
    assert f"torch=={floors.get('torch')} torchvision=={floors.get('torchvision')}" == pair, (floors, pair)
