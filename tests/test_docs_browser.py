"""The built docs open in headless Chromium with no console error and the diagrams render (issue 10).

Chromium loads the pages from disk (no network: the site has no CDN dependency).  For the
state-machine page the test dumps the rendered DOM and checks the inline SVG nodes, then takes
a screenshot and checks that the diagram's region holds drawn (non-background) pixels.  The
region comes from the browser itself: a copy of the page carries a one-line script that writes
the diagram's bounding box into the DOM.  Skipped only when Chromium is not installed
(``.ci/setup`` installs the Debian package ``chromium`` when run as root).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from decodespec.checks.docs import pages as docs

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="Chromium not installed: apt-get install chromium (.ci/setup does this as root)"),
    pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz 'dot' not installed: apt-get install graphviz"),
]

PAGES = ("index.html", "glossary.html", "generated/state-machine.html", "generated/transitions.html",
         "generated/policy.html", "generated/errors.html", "generated/envelope.html", "generated/results.html", "matrix.html")

WIDTH = 1400


def chromium(tmp: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run headless Chromium with a throwaway profile and console logging on stderr."""
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp / 'chromium-profile'}", "--enable-logging=stderr", "--v=0",
           "--force-device-scale-factor=1", "--hide-scrollbars", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def console_messages(stderr: str) -> list[str]:
    """Every page console message (errors, failed loads, logs) Chromium reported."""
    return [ln for ln in stderr.splitlines() if ":CONSOLE" in ln or "Uncaught" in ln]


@contextlib.contextmanager
def layout_probe(page: Path, measure_js: str, tmp_path: Path) -> Iterator[tuple[Path, list[Any]]]:
    """A copy of ``page`` whose load handler writes ``JSON.stringify(<measure_js>)`` into the DOM; yields the copy and the
    browser's value (e.g. an element's bounding box).  The copy is removed afterwards."""
    probe = page.with_name(page.stem + "-probe.html")
    script = ("<script>window.addEventListener('load',function(){document.body.setAttribute('data-rect',"
              f"JSON.stringify({measure_js}));}});</script>")
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", script + "</body>"), encoding="utf-8")
    try:
        proc = chromium(tmp_path, f"--window-size={WIDTH},1000", "--dump-dom", probe.as_uri())
        rect_m = re.search(r'data-rect="([^"]+)"', proc.stdout)
        assert rect_m, proc.stderr[-2000:]
        yield probe, json.loads(rect_m.group(1).replace("&quot;", '"'))
    finally:
        probe.unlink()


def screenshot(probe: Path, tmp_path: Path, height: float, name: str) -> Path:
    """A full-width screenshot of ``probe``, ``height`` pixels tall, with no console message."""
    shot = tmp_path / name
    proc = chromium(tmp_path, f"--window-size={WIDTH},{int(height)}", f"--screenshot={shot}", probe.as_uri())
    assert shot.is_file(), proc.stderr[-2000:]
    assert console_messages(proc.stderr) == []
    return shot


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> docs.BuildResult:
    root = tmp_path_factory.mktemp("browser-site")
    (root / "results").mkdir()
    result = docs.build_site(root / "html", results_dir=root / "results")
    assert result.ok, "\n".join(result.warnings + tuple(result.coverage.problems()))
    return result


def test_console_detection_sees_errors(tmp_path: Path) -> None:
    """The console check itself can fail: a page with a script error is reported."""
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><script>undefined_function_xyz();</script></body></html>")
    proc = chromium(tmp_path, "--dump-dom", bad.as_uri())
    assert any("undefined_function_xyz" in m for m in console_messages(proc.stderr)), proc.stderr[-2000:]


@pytest.mark.parametrize("page", PAGES)
def test_page_opens_without_console_errors(site: docs.BuildResult, tmp_path: Path, page: str) -> None:
    proc = chromium(tmp_path, f"--window-size={WIDTH},1000", "--dump-dom", (site.out_dir / page).as_uri())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert console_messages(proc.stderr) == []
    assert "<h1>" in proc.stdout  # the page body rendered


def test_diagram_svg_is_rendered_and_visible(site: docs.BuildResult, tmp_path: Path) -> None:
    page = site.out_dir / "generated" / "state-machine.html"
    # 1. the rendered DOM holds the inline SVG with its nodes and edges
    proc = chromium(tmp_path, f"--window-size={WIDTH},1000", "--dump-dom", page.as_uri())
    dom = proc.stdout
    m = re.search(r'<div class="decodespec-diagram" id="diagram-spine">\s*<svg(.*?)</svg>', dom, re.DOTALL)
    assert m, "spine diagram SVG missing from the rendered DOM"
    svg = m.group(1)
    graph = docs.commit_spine_graph()
    assert svg.count('class="node"') == graph.number_of_nodes()
    assert svg.count('class="edge"') == graph.number_of_edges()
    assert "PENDING_NEXT_CALL" in svg and "CLOSED_UNPROCESSED" in svg

    # 2. the browser's own layout of the diagram: a copy of the page writes the bounding box
    measure = ("(function(){var r=document.getElementById('diagram-spine').querySelector('svg').getBoundingClientRect();"
               "return [r.left,r.top+window.scrollY,r.width,r.height];})()")
    with layout_probe(page, measure, tmp_path) as (probe, (left, top, width, height)):
        assert width > 200 and height > 300, (width, height)
        # 3. a screenshot tall enough to hold the diagram; its region has drawn pixels
        shot = screenshot(probe, tmp_path, top + height + 100, "state-machine.png")
    import numpy as np
    from PIL import Image

    img = Image.open(shot).convert("L")
    region = np.asarray(img.crop((int(left), int(top), int(left + width), int(top + height))))
    dark = float((region < 128).mean())  # lines and text
    drawn = float((region < 245).mean())
    assert dark > 0.005, f"diagram region nearly blank: {dark:.4f} of its pixels are dark"
    assert drawn < 0.6, "diagram region is a solid block, not a drawing"
    shutil.copy(shot, site.out_dir.parent / "state-machine.png")  # kept beside the site for a look


def test_conformance_matrix_renders_with_colored_cells(site: docs.BuildResult, tmp_path: Path) -> None:
    """The matrix page (docs/matrix.md, issue 18): its table lays out one row per case and one column per runtime, and
    its screenshot shows the table's text and the colored results."""
    from decodespec.checks.gate.matrix import build_matrix

    expected = build_matrix()
    page = site.out_dir / "matrix.html"
    measure = ("(function(){var t=document.querySelector('table.decodespec-matrix');var r=t.getBoundingClientRect();"
               "return [r.left,r.top+window.scrollY,r.width,r.height,t.rows.length,t.rows[0].cells.length];})()")
    with layout_probe(page, measure, tmp_path) as (probe, (left, top, width, height, rows, cols)):
        assert rows == len(expected.rows) + 1 and cols == len(expected.runtimes) + 1, (rows, cols)
        assert width > 300 and height > 20 * len(expected.rows), (width, height)
        shot = screenshot(probe, tmp_path, top + height + 50, "matrix.png")
    import numpy as np
    from PIL import Image

    img = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    region = img[int(top):int(top + height), int(left):int(left + width)]
    red, green, blue = region[..., 0], region[..., 1], region[..., 2]
    passed = float(((green > red + 40) & (green > blue + 20)).mean())  # .m-pass, #17631b
    assert float((region.sum(axis=-1) < 300).mean()) > 0.005, "matrix region nearly blank"
    assert passed > 0.0005, f"no green 'pass' cell drawn ({passed:.5f} of the pixels)"
    shutil.copy(shot, site.out_dir.parent / "matrix.png")  # kept beside the site for a look
