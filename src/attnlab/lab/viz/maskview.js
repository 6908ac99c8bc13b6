// attnlab mask view: a block map (one canvas pixel per block) and, on a click, the block's cells.
// Inlined; no network. Each root [data-attnlab-mask] is set up once; its ids start with its data-prefix.
// A side (mask a, mask b) holds its block states (uint8: 0 empty, 1 partial, 2 full) and, for partial
// blocks, either per-row key intervals lo <= k <= hi (int32, with segments qseg[q] == kseg[k]) or
// packed bit tiles (block x block, row-major, little-endian bits). A diff adds bits per block:
// 1 = a cell in both, 2 = a cell only in a, 4 = a cell only in b.
(function () {
  "use strict";
  var STATE = [[241, 245, 249], [147, 197, 253], [29, 78, 216]];
  var DIFF = { none: [241, 245, 249], same: [148, 163, 184], a: [37, 99, 235], b: [234, 88, 12], ab: [147, 51, 234] };

  document.querySelectorAll("[data-attnlab-mask]").forEach(function (root) {
    if (root.dataset.maskReady) return;
    root.dataset.maskReady = "1";
    var started = performance.now();
    init(root);
    root.dataset.renderMs = (performance.now() - started).toFixed(1);
  });

  function bytes(text) {
    var raw = atob(text || ""), out = new Uint8Array(raw.length);
    for (var i = 0; i < raw.length; i++) out[i] = raw.charCodeAt(i);
    return out;
  }
  function ints(text) { var b = bytes(text); return new Int32Array(b.buffer, 0, b.length >> 2); }

  function side(raw, n, block) {
    var s = { states: bytes(raw.states), label: raw.label, nk: n[1], block: block };
    if (raw.lo !== undefined) {
      s.lo = ints(raw.lo); s.hi = ints(raw.hi);
      if (raw.qseg !== undefined) { s.qseg = ints(raw.qseg); s.kseg = ints(raw.kseg); }
    } else {
      s.tiles = new Map(); s.bits = bytes(raw.bits);
      var per = Math.ceil(block * block / 8);
      raw.tiles.forEach(function (index, k) { s.tiles.set(index, k * per); });
    }
    return s;
  }

  // 1 allowed, 0 not, null unknown (a partial block whose tile did not fit the page's budget)
  function allowed(s, q, k) {
    var bi = Math.floor(q / s.block), bj = Math.floor(k / s.block), st = s.states[bi * s.nk + bj];
    if (st !== 1) return st === 2 ? 1 : 0;
    if (s.lo) return (k >= s.lo[q] && k <= s.hi[q] && (!s.qseg || s.qseg[q] === s.kseg[k])) ? 1 : 0;
    var at = s.tiles.get(bi * s.nk + bj);
    if (at === undefined) return null;
    var bit = (q - bi * s.block) * s.block + (k - bj * s.block);
    return (s.bits[at + (bit >> 3)] >> (bit & 7)) & 1;
  }

  function diffColour(bits) {
    if (bits & 2 && bits & 4) return DIFF.ab;
    if (bits & 2) return DIFF.a;
    if (bits & 4) return DIFF.b;
    return bits & 1 ? DIFF.same : DIFF.none;
  }

  function init(root) {
    var prefix = root.dataset.prefix || "";
    function byId(name) { return document.getElementById(prefix + name); }
    var data = JSON.parse(byId("attnlab-mask").textContent);
    var nq = data.n[0], nk = data.n[1], block = data.block;
    var a = side(data.a, data.n, block), b = data.b ? side(data.b, data.n, block) : null;
    var diff = data.diff ? bytes(data.diff) : null;
    var map = byId("mk-map"), zoom = byId("mk-zoom"), cellInfo = byId("mk-cell"), zoomTitle = byId("mk-zoom-title");
    var image = map.getContext("2d").createImageData(nk, nq), px = image.data;
    for (var i = 0; i < nq * nk; i++) {
      var c = diff ? diffColour(diff[i]) : STATE[a.states[i]];
      px[4 * i] = c[0]; px[4 * i + 1] = c[1]; px[4 * i + 2] = c[2]; px[4 * i + 3] = 255;
    }
    map.getContext("2d").putImageData(image, 0, 0);
    var chosen = null, cell = 1, margin = 34;

    map.addEventListener("click", function (event) {
      var box = map.getBoundingClientRect();
      var bi = Math.min(nq - 1, Math.floor((event.clientY - box.top) / box.height * nq));
      var bj = Math.min(nk - 1, Math.floor((event.clientX - box.left) / box.width * nk));
      var t0 = performance.now();
      choose(bi, bj);
      root.dataset.zoomMs = (performance.now() - t0).toFixed(1);
    });
    zoom.addEventListener("mousemove", function (event) {
      if (!chosen) return;
      var box = zoom.getBoundingClientRect(), scale = zoom.width / box.width;
      var x = ((event.clientX - box.left) * scale - margin) / cell, y = ((event.clientY - box.top) * scale - margin) / cell;
      if (x < 0 || y < 0 || x >= chosen.cols || y >= chosen.rows) return;
      var q = chosen.qs + Math.floor(y), k = chosen.ks + Math.floor(x);
      cellInfo.textContent = "query " + q + ", key " + k + ": " + describe(q, k);
    });

    root.attnlabCell = describe;  // what a hover says of one cell (the browser test reads it)

    function describe(q, k) {
      var x = allowed(a, q, k);
      if (!b) return x === null ? "not stored (the page's byte budget)" : (x ? "allowed" : "masked");
      var y = allowed(b, q, k);
      if (x === null || y === null) return "not stored (the page's byte budget)";
      return x && y ? "in both" : x ? "only in a" : y ? "only in b" : "in neither";
    }

    function colour(q, k) {
      var x = allowed(a, q, k);
      if (!b) return x === null ? [252, 165, 165] : x ? STATE[2] : STATE[0];
      var y = allowed(b, q, k);
      if (x === null || y === null) return [252, 165, 165];
      return x && y ? DIFF.same : x ? DIFF.a : y ? DIFF.b : DIFF.none;
    }

    // The chosen block outlined on the map (a block may be one pixel: the marker is at least 8 px, centred on it).
    function mark(bi, bj) {
      var marker = byId("mk-mark"), w = map.clientWidth / nk, h = map.clientHeight / nq;
      var mw = Math.max(8, w), mh = Math.max(8, h);
      marker.style.left = (bj * w + w / 2 - mw / 2 - 2) + "px";
      marker.style.top = (bi * h + h / 2 - mh / 2 - 2) + "px";
      marker.style.width = (mw + 4) + "px"; marker.style.height = (mh + 4) + "px";
      marker.hidden = false;
    }

    function choose(bi, bj) {
      var qs = bi * block, ks = bj * block;
      var rows = Math.min(block, data.size[0] - qs), cols = Math.min(block, data.size[1] - ks);
      chosen = { qs: qs, ks: ks, rows: rows, cols: cols };
      cell = Math.max(2, Math.floor(384 / Math.max(rows, cols)));
      zoom.width = margin + cols * cell; zoom.height = margin + rows * cell;
      zoom.style.width = zoom.width + "px";
      var ctx = zoom.getContext("2d"), img = ctx.createImageData(cols * cell, rows * cell), p = img.data, count = 0;
      for (var r = 0; r < rows; r++) {
        for (var c = 0; c < cols; c++) {
          var col = colour(qs + r, ks + c);
          if (allowed(a, qs + r, ks + c)) count++;
          for (var y = 0; y < cell; y++) {
            var at = 4 * ((r * cell + y) * cols * cell + c * cell);
            for (var x = 0; x < cell; x++, at += 4) {
              var edge = cell > 3 && (x === cell - 1 || y === cell - 1);
              p[at] = edge ? 255 : col[0]; p[at + 1] = edge ? 255 : col[1]; p[at + 2] = edge ? 255 : col[2]; p[at + 3] = 255;
            }
          }
        }
      }
      ctx.clearRect(0, 0, zoom.width, zoom.height);
      ctx.putImageData(img, margin, margin);
      ctx.fillStyle = "#334155"; ctx.font = "9px sans-serif";
      var step = Math.max(1, Math.ceil(24 / cell));
      for (var i = 0; i < Math.max(rows, cols); i += step) {
        if (i < cols) { ctx.save(); ctx.translate(margin + i * cell + cell / 2 + 3, margin - 3); ctx.rotate(-Math.PI / 2);
          ctx.fillText(String(ks + i), 0, 0); ctx.restore(); }
        if (i < rows) ctx.fillText(String(qs + i), 0, margin + i * cell + cell / 2 + 3);
      }
      zoomTitle.textContent = "Queries " + qs + "\u2013" + (qs + rows - 1) + ", keys " + ks + "\u2013" + (ks + cols - 1) +
        ": " + count + " of " + rows * cols + " cells allowed" + (b ? " in a" : "") + ". Hover a cell.";
      mark(bi, bj);
      root.dataset.block = bi + "," + bj;
      root.dataset.zoomAllowed = String(count);
    }
  }
})();
