"""The report opened in a real headless Chromium (Selenium, the system chromedriver): no
console errors, every chart drawn with a size, every image decoded, the x-axis switch
working. Full-page screenshots go to test-artifacts/. Skipped only when no Chromium is
installed (scripts/test.sh installs it with apt-get where it can)."""

from __future__ import annotations

import base64
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from regen.cli import main
from regen.report import make_report
from tests.test_report import image_run, rl_rows, synthetic_run, video_run

pytestmark = pytest.mark.extended  # a real browser: the CI's second tier (scripts/test_extended.sh installs it)

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--window-size=1400,1000"]

if not (Path(CHROMIUM).is_file() and Path(CHROMEDRIVER).is_file()):
    pytest.skip(f"no Chromium found ({CHROMIUM}, {CHROMEDRIVER}): apt-get install chromium chromium-driver "
                "(scripts/test_extended.sh does this as root)", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed: pip install -e '.[dev]'")


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in FLAGS:
        opts.add_argument(flag)
    profile = tempfile.mkdtemp(prefix="regen-chromium-")
    opts.add_argument(f"--user-data-dir={profile}")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # an explicit driver path: selenium never tries to download one
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def open_report(driver, path: Path) -> None:
    driver.get_log("browser")  # drop messages of the previous page
    driver.get(path.resolve().as_uri())  # returns after the load event: images decoded


def severe(driver) -> list[dict]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def chart_sizes(driver, mode: str) -> list[tuple[float, float]]:
    """Rendered (width, height) of every training chart drawn on one x axis."""
    return driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map(s => {"
        " const r = s.getBoundingClientRect(); return [r.width, r.height]; });",
        f"#curves figure.ax-{mode} svg.chart")


def images(driver) -> list[tuple[bool, int]]:
    return driver.execute_script(
        "return [...document.querySelectorAll('img.media')].map(i => [i.complete, i.naturalWidth]);")


def screenshot(driver, name: str) -> Path:
    """The whole page, not only the window (Chrome DevTools: capture beyond the viewport)."""
    size = driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
    clip = {"x": 0, "y": 0, "width": size["width"], "height": min(size["height"], 16000), "scale": 1}
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True,
                                                             "clip": clip})
    ARTIFACTS.mkdir(exist_ok=True)
    out = ARTIFACTS / name
    out.write_bytes(base64.b64decode(shot["data"]))
    return out


def test_real_run_report_renders(browser, tmp_path):
    from selenium.webdriver.common.by import By

    run = tmp_path / "grpo"
    assert main(["train", "model.init=arith-char-gpt2", f"run.dir={run}", "train.steps=6", "eval.every=2",
                 "eval.num_prompts=16", "rollout.global_batch_size=16", "rollout.group_size=4",
                 "rollout.max_new_tokens=5", "checkpoint.every=3", "log.progress=none", "log.tensorboard=false",
                 "optim.lr=1e-3", "reward=[{name: format, args: {pattern: '.*[02468]', require_eos: false}}]"]) == 0
    html = make_report([run]).read_text()
    open_report(browser, run / "report.html")
    assert severe(browser) == []
    n = html.split('<section id="lengths">')[0].count('<figure class="plot ax-step"')
    sizes = chart_sizes(browser, "step")
    assert len(sizes) == n >= 10 and all(w > 100 and h > 30 for w, h in sizes), sizes
    assert all(w == 0 for w, _ in chart_sizes(browser, "time"))  # the other axes are hidden
    browser.find_element(By.CSS_SELECTOR, "label[for=x-time]").click()
    assert all(w > 100 for w, _ in chart_sizes(browser, "time"))
    assert all(w == 0 for w, _ in chart_sizes(browser, "step"))
    browser.find_element(By.CSS_SELECTOR, "label[for=x-step]").click()
    assert browser.find_elements(By.CSS_SELECTOR, "table.compare .sample")  # first vs last evaluation
    assert screenshot(browser, "report-real-run.png").stat().st_size > 10_000


def test_image_and_video_reports_load_their_media(browser, tmp_path):
    for make, name in ((image_run, "images"), (video_run, "videos")):
        run = make(tmp_path / name)
        open_report(browser, make_report([run]))
        assert severe(browser) == [], name
        loaded = images(browser)
        assert len(loaded) == 12 and all(done and width > 0 for done, width in loaded), (name, loaded)
        missing = browser.execute_script("return document.querySelectorAll('.missing').length")
        assert missing == 8 if name == "images" else missing == 4  # bad rows, in every place they are shown
        screenshot(browser, f"report-{name}.png")


def test_overlay_of_three_runs_renders(browser, tmp_path):
    from selenium.webdriver.common.by import By

    alerts = [{"time": time.time(), "step": 6, "kind": "reward_missing", "message": "25% of rewards missing"}]
    runs = [image_run(tmp_path / "img"), video_run(tmp_path / "vid"),
            synthetic_run(tmp_path / "live", rl_rows(14), total=40, tail='{"step": 15', alerts=alerts,
                          checkpoints={5: True, 10: True})]
    out = make_report(runs, tmp_path / "overlay.html")
    open_report(browser, out)
    assert severe(browser) == []
    for mode in ("step", "samples", "time"):
        browser.find_element(By.CSS_SELECTOR, f"label[for=x-{mode}]").click()
        sizes = chart_sizes(browser, mode)
        assert sizes and all(w > 100 and h > 30 for w, h in sizes), (mode, sizes)
        reward = browser.find_element(By.CSS_SELECTOR, f'#curves figure.ax-{mode}[data-chart="reward"]')
        assert len(reward.find_elements(By.CSS_SELECTOR, "path.series")) == 3
    assert len(browser.find_elements(By.CSS_SELECTOR, "#curves > .legend .key")) == 3
    browser.find_element(By.CSS_SELECTOR, "label[for=x-step]").click()
    screenshot(browser, "report-overlay.png")
