"""report.md / report.html of a hostile study spec: no user string becomes markup, no script runs, and only
the study's own PNGs are embedded."""

import base64
import re
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml
from PIL import Image

from kilolayer.study.findings import FINDINGS
from kilolayer.study.report import embeddable_image, render_html, write_report
from kilolayer.study.runner import Result
from kilolayer.study.spec import expand, load_spec
from kilolayer.verdicts.rule import HELD, Finding, Verdict

CHROMIUM = Path("/usr/bin/chromium")

# each payload leaves its own marker in the page if the browser ever runs it
IMG = "<img src=x onerror=\"document.body.setAttribute('data-pwned-img','1')\">"
SCRIPT = "<script>document.title='PWNED-script'</script>"
SVG = "<svg onload=\"document.body.setAttribute('data-pwned-svg','1')\"></svg>"
IFRAME = "<iframe srcdoc=\"<script>parent.document.body.setAttribute('data-pwned-iframe','1')</script>\"></iframe>"
DETAILS = "<details open ontoggle=\"document.body.setAttribute('data-pwned-details','1')\">x</details>"
PAYLOADS = (IMG, SCRIPT, SVG, IFRAME, DETAILS)
BLOCK = "\n\n".join(PAYLOADS)  # each also as a raw HTML block of its own
MARKERS = ("data-pwned-img", "data-pwned-svg", "data-pwned-details", "data-pwned-iframe", "PWNED-script")

BASE = {
    "model": {
        "arch": "encoder_decoder",
        "scheme": "deepnorm",
        "layers": 1,
        "decoder_layers": 1,
        "width": 32,
        "heads": 2,
        "ffn": 64,
        "vocab_size": 13,
        "max_len": 12,
    },
    "objective": {"name": "seq2seq"},
    "data": {"name": "synthetic", "task": "reverse"},
    "train": {"steps": 4, "batch_size": 8},
}


def _png(path: Path, colour) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (6, 4), colour).save(path)
    return path


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


@pytest.fixture
def hostile_report(tmp_path):
    """write_report on a spec whose name, description, group description, grid values, run reasons and
    finding text all carry script payloads; the finding also points at images outside the study directory."""
    out = tmp_path / "study"
    inside = _png(out / "report_files" / "inside.png", "green")
    outside = _png(tmp_path / "outside.png", "red")
    (out / "report_files" / "link.png").symlink_to(outside)
    (out / "report_files" / "fake.png").write_text("<script>not a png</script>")

    def hostile(results, out_dir):
        return Finding(
            name="hostile",
            title=f"title {SCRIPT}",
            claim=f"claim {IMG} [click](javascript:alert(1))",
            reference=f"ref {SVG} [tab](java\tscript:alert(1))",
            rule=f"rule\n\n{BLOCK}\n\n",
            verdict=Verdict(HELD, reason=f"reason {IFRAME}"),
            headers=["h", f"head {IMG}"],
            rows=[[f"cell {SCRIPT}", f"multi\n\n{DETAILS}"]],
            scale_up=f"scale {SVG} ![remote](http://example.com/t.png)",
            notes=[f"note {IMG}", f"note {SCRIPT}"],
            plots=[
                (str(inside), f"inside {IMG}"),
                (str(outside), "absolute, outside"),
                (str(out_dir / "report_files" / ".." / ".." / "outside.png"), "dot-dot, outside"),
                (str(out_dir / "report_files" / "link.png"), "symlink to outside"),
                (str(out_dir / "report_files" / "fake.png"), "not a PNG"),
            ],
        )

    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(
        yaml.safe_dump(
            {
                "name": f"study {SCRIPT}",
                "description": f"desc {IMG}\n\n{BLOCK}\n\n```\n{SCRIPT}\n```\n",
                "groups": [
                    {
                        "name": "g",
                        "description": f"group {SVG}",
                        "base": BASE,
                        "grid": {"data.path": [IMG, f"{SCRIPT}```\n{SVG}"]},
                    }
                ],
                "findings": ["hostile"],
            }
        )
    )
    with FINDINGS.added("hostile", hostile):  # the spec names it; the report evaluates it
        spec = load_spec(spec_path)
        results = [
            Result(
                point=p,
                status="failed",
                reason=f"reason {DETAILS}",
                step=3,
                eval={f"k {SCRIPT}": 1.5},
                command=f"kilolayer train {p.name}",
            )
            for p in expand(spec)
        ]
        md, page, _ = write_report(spec, results, out, 1.0)
    return md, page, inside, outside


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def _tags(page: str) -> list[tuple[str, dict]]:
    parser = _Tags()
    parser.feed(page)
    return parser.tags


ALLOWED_TAGS = {
    "html",
    "head",
    "meta",
    "title",
    "style",
    "body",
    "h1",
    "h2",
    "p",
    "ul",
    "li",
    "strong",
    "em",
    "table",
    "thead",
    "tbody",
    "tr",
    "th",
    "td",
    "code",
    "pre",
    "img",
    "a",
    "br",
    "hr",
}


def test_hostile_strings_are_text_in_report_html(hostile_report):
    md, page, inside, outside = hostile_report
    text = page.read_text()
    tags = _tags(text)
    assert {t for t, _ in tags} <= ALLOWED_TAGS, {t for t, _ in tags} - ALLOWED_TAGS
    for tag, attrs in tags:
        assert not any(a.lower().startswith("on") for a in attrs), (tag, attrs)
        if tag == "img":
            assert attrs["src"].startswith("data:image/png;base64,"), attrs
        if tag == "a" and "href" in attrs:
            assert re.sub(r"[\x00-\x20]", "", attrs["href"]).lower().startswith(("http", "mailto")), attrs
    # the payloads are shown as text, escaped (the parser above never saw them as tags)
    assert "study &lt;script&gt;document.title='PWNED-script'&lt;/script&gt;" in text
    assert "desc &lt;img src=x onerror=" in text and "&lt;details open ontoggle=" in text
    assert "<li>note &lt;img src=x onerror=" in text
    assert "<title>kilolayer study: study &lt;script&gt;" in text
    # the javascript: links keep their text and lose their target
    assert "<a>click</a>" in text and "<a>tab</a>" in text


def test_only_the_studys_own_pngs_are_embedded(hostile_report):
    _, page, inside, outside = hostile_report
    text = page.read_text()
    assert _b64(inside) in text
    assert _b64(outside) not in text  # absolute, "..", symlink: all lead outside the study directory
    assert text.count("[image not embedded:") == 5  # 4 plots outside or not PNG + the remote image
    assert "example.com" not in "".join(a.get("src", "") for t, a in _tags(text) if t == "img")
    assert "Content-Security-Policy" in text and "default-src 'none'" in text


def test_embeddable_image_rules(tmp_path):
    out = tmp_path / "study"
    png = _png(out / "a.png", "blue")
    _png(tmp_path / "b.png", "red")
    assert embeddable_image("a.png", out) == png.resolve()
    assert embeddable_image("x/../a.png", out) == png.resolve()  # ".." that stays inside is fine
    for src in (
        "../b.png",
        str(tmp_path / "b.png"),
        str(png),
        "file:a.png",
        "data:image/png;base64,AAAA",
        "http://example.com/a.png",
        "",
        "missing.png",
    ):
        assert embeddable_image(src, out) is None, src


def test_hostile_strings_are_not_markup_in_report_md(hostile_report):
    md, _, _, _ = hostile_report
    inside_code = False
    fence = None
    for line in md.read_text().splitlines():
        if fence is None and re.match(r"^`{3,}", line):
            fence, inside_code = re.match(r"^`+", line).group(0), True
            continue
        if fence is not None and line == fence:
            fence, inside_code = None, False
            continue
        if not inside_code:
            assert not re.search(r"<[A-Za-z/!?]", line), line
    assert fence is None  # every fence closed: a ``` inside a grid value did not end the commands block


def test_verdict_words_stay_coloured(tmp_path):
    page = render_html(
        "# t\n\n| a | b |\n|---|---|\n| x | **held** |\n\n**Verdict: did not hold.** because\n", tmp_path
    )
    assert '<strong class="held">held</strong>' in page
    assert '<strong class="not-held">Verdict: did not hold.</strong>' in page
    assert "<table>" in page and "<td>x</td>" in page


# ---------------------------------------------------------------- a real browser


def _dom(page: Path, tmp_path: Path) -> str:
    profile = tmp_path / "chromium-profile"
    proc = subprocess.run(
        [
            str(CHROMIUM),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={profile}",
            "--virtual-time-budget=2000",
            "--dump-dom",
            page.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _fired(dom: str) -> set[str]:
    """The markers a payload left: attributes on <body>, or the document title replaced by the script's."""
    body = re.search(r"<body[^>]*>", dom).group(0)
    title = re.search(r"<title>(.*?)</title>", dom, re.S)
    fired = {m for m in MARKERS if re.search(rf"\b{m}=", body)}
    return fired | ({"PWNED-script"} if title and title.group(1).strip() == "PWNED-script" else set())


@pytest.mark.integration
@pytest.mark.slow  # starts Chromium three times: ~10 s
@pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="needs Debian's chromium at /usr/bin/chromium (apt-get install -y chromium; CI installs it)",
)
def test_no_script_runs_in_chromium(hostile_report, tmp_path):
    _, page, _, _ = hostile_report
    # the harness itself: the same payloads as raw HTML do fire in this browser
    control = tmp_path / "control.html"
    control.write_text(f"<!doctype html><html><head><title>control</title></head><body>{BLOCK}</body></html>")
    assert _fired(_dom(control, tmp_path)) == set(MARKERS)
    # the report as written
    dom = _dom(page, tmp_path)
    assert _fired(dom) == set()
    assert "kilolayer study: study" in dom and "data:image/png;base64," in dom
    # and without its Content-Security-Policy: the escaping alone keeps every payload inert
    bare = page.with_name("report_without_csp.html")
    bare.write_text(re.sub(r"<meta http-equiv='Content-Security-Policy'[^>]*>", "", page.read_text()))
    assert "Content-Security-Policy" not in bare.read_text()
    assert _fired(_dom(bare, tmp_path)) == set()


@pytest.mark.parametrize(
    "href",
    ["javascript&#58;alert(1)", "&#106;avascript:alert(1)", "java&#x09;script:alert(1)", "javascript&colon;alert(1)"],
)
def test_entity_encoded_javascript_links_are_not_links(tmp_path, href):
    from kilolayer.study.report import render_html

    page = render_html(f"# t\n\n[a]({href}) and [b](https://example.org)\n", tmp_path)
    assert "<a>a</a>" in page  # the link lost its href
    assert 'href="https://example.org"' in page and page.count("href=") == 1
