/* cellmap: begin (shared by index.html and trace.html, put in by kvlayout.server.monitor.page) */
const CELLMAP = (() => {
  const FREE = "#e2e2e7", CACHED = "#e0a800", SHARED = "#3d0d5c";
  const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#17becf", "#e377c2", "#8c564b",
                   "#9467bd", "#7f9c1a", "#005f73", "#ff9896", "#98df8a", "#5c6bc0"];  // none near gold or the dark purple
  const SEQ0 = 3, SEQ_CLASSES = 253;
  const color = (c) => c === 0 ? FREE : c === 1 ? CACHED : c === 2 ? SHARED : PALETTE[(c - SEQ0) % PALETTE.length];
  const className = (c) => c === 0 ? "free" : c === 1 ? "cached prefix" : c === 2 ? "shared by several live sequences"
    : "live sequence " + (c - SEQ0) + (c - SEQ0 === SEQ_CLASSES - 1 ? "+" : "");
  const decode = (b64) => Uint8Array.from(atob(b64 || ""), (ch) => ch.charCodeAt(0));
  const stats = (f) => `used ${f.used} of ${f.capacity} cells · ${f.live.length} live sequences · ` +
    `cached ${f.cached} · held once for several owners ${f.shared}` +
    (f.shared_live === undefined ? "" : ` (${f.shared_live} by live sequences)`) + ` · step ${f.step}`;
  const range = (f, i) => { const a = i * f.bucket, b = Math.min(a + f.bucket, f.capacity) - 1; return [a, b]; };

  // Squares as large as fit the canvas's box and a height of 60% of the window (14 to 3 px), then
  // as many columns as fit, a power of two (rows of 64 or 128 cells read easily).
  function layout(n, width) {
    const tall = Math.max(160, Math.min(560, Math.round(window.innerHeight * 0.6)));
    const fit = (s) => Math.max(1, Math.min(n, 2 ** Math.floor(Math.log2(Math.max(1, width / s)))));
    let size = 14;
    while (size > 3 && Math.ceil(n / fit(size)) * size > tall) size--;
    return [fit(size), size];
  }
  function create(canvas, legendEl) {
    const ctx = canvas.getContext("2d");
    const state = window.kvlayoutMap = { frames: 0, lastFrame: null, drawnOccupied: 0, cols: 1, size: 1 };
    let classes = new Uint8Array(0), cols = 1, size = 1, legendKey = null;
    function draw(f) {
      classes = decode(f.classes);
      const n = Math.min(f.buckets, classes.length);
      [cols, size] = layout(Math.max(1, n), Math.max(192, canvas.parentElement.clientWidth));
      const w = cols * size, h = Math.max(1, Math.ceil(n / cols)) * size;
      if (canvas.width !== w || canvas.height !== h) { canvas.width = w; canvas.height = h; canvas.style.width = w + "px"; }
      ctx.fillStyle = "#ffffff";
      ctx.fillRect(0, 0, w, h);
      const gap = size >= 6 ? 1 : 0;
      let occupied = 0;
      for (let i = 0; i < n; i++) {
        const c = classes[i];
        if (c !== 0) occupied++;
        ctx.fillStyle = color(c);
        ctx.fillRect((i % cols) * size, Math.floor(i / cols) * size, size - gap, size - gap);
      }
      const key = f.live.join(",");
      if (legendEl && key !== legendKey) { legendKey = key; legend(f); }
      state.frames += 1; state.lastFrame = f; state.drawnOccupied = occupied; state.cols = cols; state.size = size;
    }
    let resized = 0;
    window.addEventListener("resize", () => {
      clearTimeout(resized);
      resized = setTimeout(() => { if (state.lastFrame) draw(state.lastFrame); }, 100);
    });
    function legend(f) {
      const items = [[0, "free"], [1, "cached prefix"], [2, "shared"]];
      const shown = f.live.slice(0, 24);
      for (const id of shown) items.push([SEQ0 + (id % SEQ_CLASSES), "seq " + id]);
      legendEl.replaceChildren(...items.map(([c, label]) => {
        const s = document.createElement("span"), sw = document.createElement("i");
        sw.style.background = color(c); s.append(sw, label); return s;
      }));
      if (f.live.length > shown.length) legendEl.append(`… ${f.live.length - shown.length} more`);
    }
    // The bucket under a mouse event, or -1.
    function bucketAt(ev) {
      const r = canvas.getBoundingClientRect();
      if (!r.width || !r.height) return -1;
      const x = (ev.clientX - r.left) * canvas.width / r.width, y = (ev.clientY - r.top) * canvas.height / r.height;
      const col = Math.floor(x / size), row = Math.floor(y / size), i = row * cols + col;
      return col >= 0 && col < cols && row >= 0 && i < classes.length ? i : -1;
    }
    return { draw, bucketAt, classOf: (i) => classes[i] };
  }
  // A tooltip near the mouse, inside the visible part of `box` (the positioned parent of `tip`):
  // left of the mouse when it would pass the right edge, above it when it would pass the bottom.
  // The bounds are the box's client size, not its scroll size: a tip past them would grow the
  // scroll size and add the scrollbar it was measured against.
  function showTip(tip, box, ev, text) {
    const r = box.getBoundingClientRect();
    tip.textContent = text; tip.hidden = false;
    tip.style.left = "0px"; tip.style.top = "0px";  // measured where it has the whole width to wrap in
    const w = tip.offsetWidth, h = tip.offsetHeight, mx = ev.clientX - r.left - box.clientLeft,
      my = ev.clientY - r.top - box.clientTop;
    const right = box.clientWidth - w - 4, bottom = box.clientHeight - h - 4;
    const x = mx + 14 <= right ? mx + 14 : Math.max(4, Math.min(right, mx - w - 14));
    const y = my + 14 <= bottom ? my + 14 : Math.max(4, my - h - 14);
    tip.style.left = (x + box.scrollLeft) + "px";
    tip.style.top = (y + box.scrollTop) + "px";
  }
  return { create, stats, range, className, showTip };
})();
/* cellmap: end */
