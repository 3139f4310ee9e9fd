#!/usr/bin/env python3
"""Screenshot TensorBoard's Custom Scalars tab in headless Chromium (Debian's `chromium` package); used by
`examples/make_pictures.sh`, which starts TensorBoard on loopback first.

    python examples/tensorboard_screenshot.py http://127.0.0.1:6006 tensorboard.png --expand

Standard library only: it speaks the Chrome DevTools Protocol over `--remote-debugging-pipe` (fd 3: commands to
Chromium, fd 4: its replies, NUL-separated JSON). It waits until every chart has its SVG lines drawn (not a blank
page or a spinner), turns off "Ignore outliers in chart scaling" (which clips the lowest curve), and with `--expand`
widens every chart and opens its "Matches" list, the legend of which marker is which key.
"""

import argparse
import base64
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--disable-dev-shm-usage",
    "--mute-audio",
    "--remote-debugging-pipe",
]

# Deep querySelectorAll through shadow roots (TensorBoard is Polymer = shadow DOM everywhere).
JS_HELPERS = r"""
window.__deepAll = function(sel, root) {
  root = root || document; const out = [];
  (function walk(n) {
    if (n.querySelectorAll) n.querySelectorAll(sel).forEach(e => out.push(e));
    const all = n.querySelectorAll ? n.querySelectorAll('*') : [];
    all.forEach(e => { if (e.shadowRoot) walk(e.shadowRoot); });
  })(root);
  return out;
};
"""

JS_STATUS = r"""
(() => {
  // open categories that the layout marks closed=True (otherwise their charts are never drawn)
  __deepAll('tf-category-paginated-view').forEach(p => { if (p.opened === false) p.opened = true; });
  const cards = __deepAll('tf-custom-scalar-multi-line-chart-card');
  const per = cards.map(c => {
    const paths = __deepAll('path.line', c.shadowRoot || c)
        .filter(p => (p.getAttribute('d') || '').length > 20);
    return paths.length;
  });
  const spinners = __deepAll('paper-spinner-lite[active], paper-spinner[active]')
      .filter(e => { const r = e.getBoundingClientRect(); return r.width > 0 && r.height > 0; }).length;
  return JSON.stringify({cards: cards.length, lines: per, spinners,
                         expanded: cards.map(c => !!c._expanded)});
})()
"""

JS_EXPAND = r"""
(() => {
  const cards = __deepAll('tf-custom-scalar-multi-line-chart-card');
  cards.forEach(c => {
    if (!c._expanded && c._toggleExpanded) c._toggleExpanded();   // = the fullscreen button
    if (c.set) c.set('_matchesListOpened', true);                 // show 'Matches' legend (tag -> marker)
  });
  return cards.length;
})()
"""


class CDP:
    def __init__(self, proc, wfd, rfd):
        self.proc, self.wfd, self.rfd = proc, wfd, rfd
        self.buf, self.next_id = b"", 0

    def _read_msg(self, deadline):
        while b"\0" not in self.buf:
            if time.time() > deadline:
                raise TimeoutError("CDP read timeout")
            chunk = os.read(self.rfd, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed the pipe (crashed?)")
            self.buf += chunk
        msg, self.buf = self.buf.split(b"\0", 1)
        return json.loads(msg)

    def send(self, method, params=None, session=None, timeout=60):
        self.next_id += 1
        mid = self.next_id
        m = {"id": mid, "method": method, "params": params or {}}
        if session:
            m["sessionId"] = session
        os.write(self.wfd, json.dumps(m).encode() + b"\0")
        deadline = time.time() + timeout
        while True:
            r = self._read_msg(deadline)
            if r.get("id") == mid:
                if "error" in r:
                    raise RuntimeError(f"{method}: {r['error']}")
                return r.get("result", {})


def main():
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally: below
    ap = argparse.ArgumentParser()
    ap.add_argument("base_url")
    ap.add_argument("out")
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--height", type=int, default=1000)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--expand", action="store_true", help="click every chart's fullscreen button")
    ap.add_argument(
        "--keep-outliers-clipping",
        action="store_true",
        help="leave TensorBoard's default 'Ignore outliers in chart scaling' on",
    )
    ap.add_argument("--smoothing", type=float, default=None)
    ap.add_argument("--timeout", type=float, default=90)
    ap.add_argument(
        "--charts", type=int, default=0, help="with --expand: show the first N charts only (0: all)"
    )
    a = ap.parse_args()

    url = a.base_url.rstrip("/") + "/#custom_scalars"
    if a.smoothing is not None:
        url += f"&_smoothingWeight={a.smoothing}"

    profile = tempfile.mkdtemp(prefix="tbshot-prof-")
    to_r, to_w = os.pipe()  # we write -> chromium reads on fd 3
    from_r, from_w = os.pipe()  # chromium writes on fd 4 -> we read
    # move child ends to high fds so dup2 onto 3/4 can't clobber them
    hi_r = fcntl.fcntl(to_r, fcntl.F_DUPFD_CLOEXEC, 100)
    hi_w = fcntl.fcntl(from_w, fcntl.F_DUPFD_CLOEXEC, 100)
    os.close(to_r)
    os.close(from_w)

    def child_fds():
        os.dup2(hi_r, 3)  # dup2 result is inheritable
        os.dup2(hi_w, 4)

    log = open(os.path.join(profile, "chromium.log"), "wb")  # noqa: SIM115  # Chromium's output while it runs
    proc = subprocess.Popen(
        [
            CHROMIUM,
            *FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={a.width},{a.height}",
            "about:blank",
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=child_fds,
        close_fds=False,
        start_new_session=True,
    )
    os.close(hi_r)
    os.close(hi_w)
    t0 = time.time()
    try:
        cdp = CDP(proc, to_w, from_r)
        targets = cdp.send("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        sid = cdp.send("Target.attachToTarget", {"targetId": page["targetId"], "flatten": True})["sessionId"]
        cdp.send("Page.enable", session=sid)
        cdp.send("Runtime.enable", session=sid)
        cdp.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": a.width, "height": a.height, "deviceScaleFactor": a.scale, "mobile": False},
            session=sid,
        )
        init = JS_HELPERS
        if not a.keep_outliers_clipping:
            # tf_storage boolean in localStorage, read at dashboard creation
            init += "\ntry{localStorage.setItem('_ignoreYOutliers','false')}catch(e){}\n"
        cdp.send("Page.addScriptToEvaluateOnNewDocument", {"source": init}, session=sid)
        cdp.send("Page.navigate", {"url": url}, session=sid)

        def ev(expr):
            r = cdp.send("Runtime.evaluate", {"expression": expr, "returnByValue": True}, session=sid)
            return r.get("result", {}).get("value")

        def wait_drawn(what):
            deadline = time.time() + a.timeout
            stable, last = 0, None
            while time.time() < deadline:
                try:
                    st = json.loads(ev(JS_STATUS) or "{}")
                except Exception:
                    st = {}
                ok = (
                    st.get("cards", 0) > 0 and all(n > 0 for n in st["lines"]) and st.get("spinners", 0) == 0
                )
                stable = stable + 1 if ok and st == last else 0
                last = st
                if stable >= 2:  # same good state 3 polls in a row
                    print(f"[tbshot] {what}: {st} after {time.time() - t0:.1f}s", file=sys.stderr)
                    return st
                time.sleep(0.5)
            raise TimeoutError(f"charts not drawn within {a.timeout}s, last status {last}")

        wait_drawn("drawn")
        if a.expand:
            ev(JS_EXPAND)
            time.sleep(1.0)
            wait_drawn("expanded")
            # grow the viewport to the full height of the dashboard content
            count = a.charts if a.charts > 0 else 1000
            h = ev(f"""(() => {{ let m = 0; __deepAll('tf-custom-scalar-multi-line-chart-card').slice(0, {count})
                  .forEach(c => {{ const r = c.getBoundingClientRect(); m = Math.max(m, r.bottom); }});
                  return Math.ceil(m + 40); }})()""")
            if h and h > a.height:
                cdp.send(
                    "Emulation.setDeviceMetricsOverride",
                    {"width": a.width, "height": int(h), "deviceScaleFactor": a.scale, "mobile": False},
                    session=sid,
                )
                time.sleep(1.0)
                wait_drawn("resized")
        time.sleep(0.5)  # let the last Plottable redraw land
        png = cdp.send("Page.captureScreenshot", {"format": "png"}, session=sid)["data"]
        with open(a.out, "wb") as f:
            f.write(base64.b64decode(png))
        print(f"[tbshot] wrote {a.out} in {time.time() - t0:.1f}s", file=sys.stderr)
        with contextlib.suppress(Exception):
            cdp.send("Browser.close", timeout=5)
    finally:
        for sig, grace in ((None, 5), (signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            if sig is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)  # chromium + its zygote/renderer/gpu children
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                pass
        log.close()
        shutil.rmtree(profile, ignore_errors=True)


if __name__ == "__main__":
    main()
