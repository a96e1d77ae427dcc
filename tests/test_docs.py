"""The documentation cannot drift from the code: the generated references list every config
field and every CLI option, the site builds with --strict, and every link the README and the
nav give points at a page that exists."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from conftest import REPO

sys.path.insert(0, str(REPO / "docs"))
import gen_reference  # noqa: E402  (docs/gen_reference.py, the mkdocs hook)


def _sections(page: str) -> dict[str, str]:
    """A generated page's text under each of its `## ` headings."""
    found, title = {}, None
    for line in page.splitlines():
        if line.startswith("## "):
            title = line[3:]
            found[title] = ""
        elif title is not None:
            found[title] += line + "\n"
    return found


def test_the_config_reference_lists_every_field_of_every_config_model():
    from pipelines.config import JobConfig

    page = gen_reference.config_reference()
    by_anchor = {re.search(r"\{#(\w+)\}", title)[1]: text
                 for title, text in _sections(page).items()}
    models = {model for _, model in gen_reference.config_sections(JobConfig)}
    assert {"jobconfig", "inputconfig", "modelconfig", "promptconfig", "samplingconfig",
            "structuredconfig", "stepconfig", "outputconfig", "resourcesconfig",
            "vllmengineconfig", "httpengineconfig"} <= {m.__name__.lower() for m in models}
    for model in models:
        text = by_anchor[model.__name__.lower()]
        for name, field in model.model_fields.items():
            row = next((line for line in text.splitlines() if line.startswith(f"| `{name}` |")),
                       None)
            assert row is not None, f"{model.__name__}.{name} is not in the config reference"
            if field.description:  # its description is the code's own words
                assert " ".join(field.description.split())[:40].replace("``", "`") \
                    .replace("|", "\\|") in row, row


def test_the_cli_reference_lists_every_subcommand_and_option():
    from pipelines.cli import build_parser

    page = gen_reference.cli_reference()
    sections = _sections(page)
    commands = gen_reference.subcommands(build_parser())
    assert {"run", "validate", "status", "report", "batch", "serve"} <= set(commands)
    for name, sub in commands.items():
        text = sections[f"`overnight {name}`"]
        for action in sub._actions:
            if action.help == "show this help message and exit":
                continue  # argparse's own -h
            for option in action.option_strings:
                assert f"`{option}`" in text, f"overnight {name} {option} is not in the CLI reference"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    site = tmp_path_factory.mktemp("docs") / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(site)], cwd=REPO, capture_output=True, text=True,
                          env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    return site


def test_the_site_builds_strictly_with_both_references(site):
    config = (site / "reference" / "config.html").read_text()
    for anchor in ("inputconfig", "samplingconfig", "outputconfig", "vllmengineconfig"):
        assert f'id="{anchor}"' in config
    assert "overnight run" in (site / "reference" / "cli.html").read_text()
    assert (site / "changelog.html").exists()


def test_the_site_links_files_not_folders_and_loads_nothing_from_the_internet(site):
    # opened from disk, a link to a folder shows a folder listing, and a script from a CDN is absent
    for page in site.rglob("*.html"):
        html = page.read_text()
        for target in re.findall(r'href="([^"#]*)"', html):
            if target and not target.startswith(("http://", "https://", "mailto:")):
                assert not target.endswith("/"), f"{page.name} links to the folder {target}"
        assert not re.search(r'<script[^>]+src="https?://', html), f"{page.name} loads a remote script"


def test_the_search_box_finds_pages_when_the_site_is_opened_from_disk(site, browser):
    from conftest import wait_until

    browser.get((site / "index.html").as_uri())
    box = browser.find_element("css selector", "input.md-search__input")
    browser.execute_script("document.getElementById('__search').click()")
    wait_until(box.is_displayed)
    box.send_keys("resume")
    wait_until(lambda: browser.find_elements("css selector", ".md-search-result__item"))
    first = browser.find_element("css selector", ".md-search-result__item a").get_attribute("href")
    assert first.startswith("file://") and first.split("?")[0].endswith("/guide/resume.html")


def _nav_pages(nav) -> list[str]:
    pages = []
    for item in nav:
        for value in (item.values() if isinstance(item, dict) else [item]):
            pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_in_the_nav_exists_and_every_page_is_in_the_nav():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    generated = {gen_reference.CONFIG_PAGE, gen_reference.CLI_PAGE, "changelog.md"}
    nav = set(_nav_pages(config["nav"]))
    for page in nav - generated:
        assert (REPO / "docs" / page).is_file(), f"mkdocs.yml names docs/{page}, which is missing"
    written = {str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md")}
    assert written <= nav, f"pages in no menu: {sorted(written - nav)}"


@pytest.mark.parametrize("page", ["README.md", *sorted(
    str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.md"))])
def test_every_relative_link_points_at_a_file_that_exists(page):
    text = (REPO / page).read_text()
    generated = {gen_reference.CONFIG_PAGE, gen_reference.CLI_PAGE, "changelog.md"}
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        where = ((REPO / page).parent / target.split("#")[0]).resolve()
        if where in {(REPO / "docs" / g).resolve() for g in generated}:
            continue  # a page docs/gen_reference.py adds when the site is built
        assert where.exists(), f"{page} links to {target}, which does not exist"


def test_the_readme_is_a_front_door():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "make demo" in readme and "make test" in readme


def test_the_project_never_speaks_of_itself_by_rounds_of_work():
    pattern = "sess" + "ion [0-9]"  # (spelled apart, so this file does not match itself)
    found = subprocess.run(["git", "grep", "-i", "-n", "-E", pattern, "--", "."], cwd=REPO,
                           capture_output=True, text=True)
    assert found.returncode in (0, 1), found.stderr
    assert found.stdout == "", found.stdout[:2000]
