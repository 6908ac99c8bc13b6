// attnlab model view (every layer x head, click to enlarge) and generation view (where each head
// looked for each generated token). Inlined; no network. Each root [data-attnlab-model] is set up once;
// its ids start with its data-prefix. Weights arrive as base64 little-endian uint16 (w * 65535), layer
// by layer, head by head, n x n cells each (blocks of `block` tokens past 256 tokens).
(function () {
  "use strict";
  var ANCHORS = ["#440154", "#482878", "#3e4989", "#31688e", "#26828e", "#1f9e89", "#35b779", "#6ece58", "#fde725"];
  var LUT = lut();
  var CHIPS = 2048;  // the most token chips drawn at once
  var HALF = null;   // fp16 -> float32 table, built on the first zoom

  document.querySelectorAll("[data-attnlab-model]").forEach(function (root) {
    if (root.dataset.modelReady) return;
    root.dataset.modelReady = "1";
    var started = performance.now();
    init(root);
    root.dataset.renderMs = (performance.now() - started).toFixed(1);
  });

  function lut() {  // 256 viridis colours, as [r, g, b] triples
    var out = new Uint8Array(256 * 3);
    for (var i = 0; i < 256; i++) {
      var t = i / 255 * (ANCHORS.length - 1), k = Math.min(Math.floor(t), ANCHORS.length - 2), f = t - k;
      for (var c = 0; c < 3; c++) {
        var a = parseInt(ANCHORS[k].substr(1 + 2 * c, 2), 16), b = parseInt(ANCHORS[k + 1].substr(1 + 2 * c, 2), 16);
        out[3 * i + c] = Math.round(a * (1 - f) + b * f);
      }
    }
    return out;
  }

  // A weight as a learner should read it: 3 significant digits, scientific below 0.001, so that a
  // small weight reads 2.40e-5, never 0.0000.
  function number(w) {
    if (w === 0 || !isFinite(w)) return String(w);
    return Math.abs(w) >= 1e-3 ? String(Number(w.toPrecision(3))) : w.toExponential(2);
  }

  function decode(text) {
    var bytes = atob(text), n = bytes.length >> 1, out = new Float32Array(n);
    for (var i = 0; i < n; i++) out[i] = (bytes.charCodeAt(2 * i) | (bytes.charCodeAt(2 * i + 1) << 8)) / 65535;
    return out;
  }

  function paint(canvas, values, offset, rows, cols) {  // square-root scale, as the matplotlib grid
    var ctx = canvas.getContext("2d"), image = ctx.createImageData(cols, rows), px = image.data;
    for (var i = 0; i < rows * cols; i++) {
      var c = 3 * Math.min(255, Math.round(Math.sqrt(values[offset + i]) * 255));
      px[4 * i] = LUT[c]; px[4 * i + 1] = LUT[c + 1]; px[4 * i + 2] = LUT[c + 2]; px[4 * i + 3] = 255;
    }
    ctx.putImageData(image, 0, 0);
  }

  function init(root) {
    var prefix = root.dataset.prefix || "";
    function byId(name) { return document.getElementById(prefix + name); }
    var data = JSON.parse(byId("attnlab-model").textContent);
    var values = decode(data.data), n = data.n, cells = n * n;
    var starts = [], at = 0;  // offset of each layer's first head
    data.heads.forEach(function (count) { starts.push(at); at += count * cells; });
    function offset(layer, head) { return starts[layer] + head * cells; }
    function weight(layer, head, row, col) { return values[offset(layer, head) + row * n + col]; }
    var state = { layer: data.layer, head: data.head, row: null };
    var big = byId("mv-big"), layerSelect = byId("mv-layer"), headSelect = byId("mv-head");
    var summary = byId("mv-summary"), tokenBox = byId("mv-tokens");

    root.querySelectorAll("canvas.mv-thumb").forEach(function (thumb) {
      var layer = Number(thumb.dataset.layer), head = Number(thumb.dataset.head);
      paint(thumb, values, offset(layer, head), n, n);
      thumb.addEventListener("click", function () { select(layer, head); });
    });
    var long = data.tokens.length > CHIPS;  // past CHIPS tokens, chips show the focused block's tokens only
    var chips = long ? [] : tokenChips(tokenBox, data.tokens, null);
    chips.forEach(function (chip, i) {
      chip.addEventListener("mouseenter", function () { focusRow(Math.floor(i / data.block)); });
    });
    var zoom = data.zoom ? zoomer(root, byId, data, state) : null;
    if (zoom) {
      big.addEventListener("click", function (event) {
        var box = big.getBoundingClientRect();
        var cell = function (x, size) { return Math.min(n - 1, Math.max(0, Math.floor(x / size * n))); };
        zoom.show(cell(event.clientY - box.top, box.height), cell(event.clientX - box.left, box.width));
      });
    }
    big.addEventListener("mousemove", function (event) {
      var box = big.getBoundingClientRect();
      focusRow(Math.min(n - 1, Math.max(0, Math.floor((event.clientY - box.top) / box.height * n))));
    });
    layerSelect.addEventListener("change", function () { select(Number(layerSelect.value), state.head); });
    headSelect.addEventListener("change", function () { select(state.layer, Number(headSelect.value)); });

    // Row or column r of the overview: a token, or a block of tokens (a range, or one token at the end).
    function label(r) {
      if (data.block === 1) return "\u2018" + data.tokens[r] + "\u2019";
      var first = r * data.block, last = Math.min(first + data.block, data.tokens.length) - 1;
      return first === last ? "token " + first + " \u2018" + data.tokens[first] + "\u2019" : "tokens " + data.rows[r];
    }
    function looks(r) { return label(r) + (data.block === 1 || r * data.block === data.tokens.length - 1 ? " looks" : " look"); }

    function focusRow(r) {
      state.row = r;
      var keys = [];
      for (var j = 0; j < n; j++) keys.push(j);
      function w(j) { return weight(state.layer, state.head, r, j); }
      keys.sort(function (a, b) { return w(b) - w(a) || a - b; });
      summary.textContent = "Layer " + state.layer + ", head " + state.head + ": " + looks(r) + " most at " +
        keys.slice(0, 3).map(function (j) { return label(j) + " (" + number(w(j)) + ")"; }).join(", ") + ".";
      var max = w(keys[0]) || 1;
      if (long) {  // the focused block's tokens, then the block it looks at most
        tokenBox.textContent = "";
        var top = keys[0], shown = [r * data.block, top * data.block];
        tokenChips(tokenBox, data.tokens.slice(shown[0], shown[0] + data.block), null)
          .forEach(function (chip) { chip.classList.add("focus"); });
        if (top !== r) {
          var gap = document.createElement("span"); gap.className = "muted"; gap.textContent = " \u2192 ";
          tokenBox.appendChild(gap);
          tokenChips(tokenBox, data.tokens.slice(shown[1], shown[1] + data.block), null);
        }
      }
      chips.forEach(function (chip, i) {
        var w = weight(state.layer, state.head, r, Math.floor(i / data.block));
        chip.style.background = "rgba(79, 70, 229, " + (0.04 + 0.66 * Math.min(1, w / max)).toFixed(3) + ")";
        chip.classList.toggle("focus", Math.floor(i / data.block) === r);
      });
      paint(big, values, offset(state.layer, state.head), n, n);  // the row read stays bright, the rest dims
      var ctx = big.getContext("2d");
      ctx.fillStyle = "rgba(255, 255, 255, 0.45)";
      ctx.fillRect(0, 0, n, r); ctx.fillRect(0, r + 1, n, n - r - 1);
      root.dataset.row = String(r);
    }

    function select(layer, head) {
      head = Math.min(head, data.heads[layer] - 1);
      state.layer = layer; state.head = head;
      layerSelect.value = String(layer); headSelect.value = String(head);
      [].forEach.call(headSelect.options, function (option) {
        option.hidden = Number(option.value) >= data.heads[layer];
      });
      root.querySelectorAll("canvas.mv-thumb").forEach(function (thumb) {
        var chosen = Number(thumb.dataset.layer) === layer && Number(thumb.dataset.head) === head;
        thumb.classList.toggle("selected", chosen);
      });
      paint(big, values, offset(layer, head), n, n);
      root.dataset.layer = String(layer); root.dataset.head = String(head);
      if (state.row !== null) focusRow(state.row);
      if (zoom && zoom.cells) zoom.show(zoom.cells[0], zoom.cells[1]);  // the same region of the new head
    }
    select(state.layer, state.head);
    if (data.row !== undefined && data.row !== null) focusRow(data.row);  // the row asked for (row=), read out
    if (data.prompt !== undefined) generation(root, byId, data, weight);
  }

  function bytesOf(text) {
    var raw = atob(text), out = new Uint8Array(raw.length);
    for (var i = 0; i < raw.length; i++) out[i] = raw.charCodeAt(i);
    return out.buffer;
  }

  function halves(text) {  // base64 little-endian fp16 -> Float32Array
    if (!HALF) {
      HALF = new Float32Array(65536);
      for (var h = 0; h < 65536; h++) {
        var sign = h & 0x8000 ? -1 : 1, exponent = (h >> 10) & 0x1f, fraction = h & 0x3ff;
        HALF[h] = exponent === 0 ? sign * fraction * Math.pow(2, -24)
          : exponent === 31 ? (fraction ? NaN : sign * Infinity)
          : sign * (1 + fraction / 1024) * Math.pow(2, exponent - 15);
      }
    }
    var bits = new Uint16Array(bytesOf(text)), out = new Float32Array(bits.length);
    for (var i = 0; i < bits.length; i++) out[i] = HALF[bits[i]];
    return out;
  }

  // A long view's zoom: a region of one head at full resolution, each weight recomputed from the
  // page's fp16 queries and keys and the row's log-sum-exp: exp(score - lse) inside the row's keys.
  function zoomer(root, byId, data, state) {
    var z = data.zoom, T = data.tokens.length, D = z.dim, cache = {};
    var canvas = byId("mv-zoom"), summary = byId("mv-zoom-summary"), region = null;
    var intervals = z.intervals.map(function (text) { return new Int32Array(bytesOf(text)); });
    function head(layer, h) {
      var id = layer + ":" + h;
      if (!(id in cache)) {
        var held = z.heads[id];
        cache[id] = held ? { q: halves(held.q), lse: new Float32Array(bytesOf(held.lse)),
                             k: halves(z.keys[layer + ":" + Math.floor(h / z.layers[layer].group)]) } : null;
      }
      return cache[id];
    }
    function span(cell) {  // one overview cell, widened to at least z.tokens tokens, within [0, T)
      var size = Math.min(T, Math.max(data.block, z.tokens));
      var start = Math.max(0, Math.min(T - size, cell * data.block + Math.floor((data.block - size) / 2)));
      return [start, start + size];
    }
    var api = { show: show, cells: null };
    function show(rowCell, colCell) {
      api.cells = [rowCell, colCell];
      var started = performance.now(), layer = state.layer, h = state.head, held = head(layer, h);
      if (!held) {
        var why = z.skipped[String(layer)] || "over the page's zoom budget of " + z.budget_mb + " MiB";
        summary.textContent = "Layer " + layer + ", head " + h + " cannot be zoomed in this page: " + why +
          ". Enlarge another head, or make the view again with this head first (layer=, head=) or a larger zoom_mb.";
        region = null; root.attnlabZoom = null; return;
      }
      var rows = span(rowCell), cols = span(colCell), info = z.layers[layer], bounds = intervals[info.bounds];
      var nr = rows[1] - rows[0], nc = cols[1] - cols[0], weights = new Float32Array(nr * nc), max = 0;
      for (var i = 0; i < nr; i++) {
        var qi = (rows[0] + i) * D, lo = bounds[2 * (rows[0] + i)], hi = bounds[2 * (rows[0] + i) + 1];
        var lse = held.lse[rows[0] + i];
        for (var j = 0; j < nc; j++) {
          var key = cols[0] + j;
          if (key < lo || key >= hi || lse === -Infinity) continue;
          var s = 0, kj = key * D;
          for (var d = 0; d < D; d++) s += held.q[qi + d] * held.k[kj + d];
          s *= info.scale;
          if (info.softcap !== null) s = info.softcap * Math.tanh(s / info.softcap);
          var w = Math.min(1, Math.exp(s - lse));  // fp16 q and k can push a near-1 weight past 1
          weights[i * nc + j] = w;
          if (w > max) max = w;
        }
      }
      canvas.width = nc; canvas.height = nr;
      paint(canvas, weights, 0, nr, nc);  // the weights themselves, on the overview's scale: 0 dark, 1 bright
      region = { layer: layer, head: h, rows: rows, cols: cols, weights: weights };
      root.attnlabZoom = region;
      summary.textContent = "Layer " + layer + ", head " + h + ": queries " + rows[0] + "\u2013" + (rows[1] - 1) +
        " x keys " + cols[0] + "\u2013" + (cols[1] - 1) + " at full resolution; colour: the weight on the overview's square-root scale (0 dark, 1 bright, the same on " +
        "every zoom). Largest weight here: " + number(max) + ". Hover a cell to read it.";
      root.dataset.zoomMs = (performance.now() - started).toFixed(1);
    }
    canvas.addEventListener("mousemove", function (event) {
      if (!region) return;
      var box = canvas.getBoundingClientRect(), nr = region.rows[1] - region.rows[0], nc = region.cols[1] - region.cols[0];
      var i = Math.min(nr - 1, Math.max(0, Math.floor((event.clientY - box.top) / box.height * nr)));
      var j = Math.min(nc - 1, Math.max(0, Math.floor((event.clientX - box.left) / box.width * nc)));
      var qi = region.rows[0] + i, kj = region.cols[0] + j;
      summary.textContent = "Layer " + region.layer + ", head " + region.head + ": query " + qi + " \u2018" +
        data.tokens[qi] + "\u2019 gives key " + kj + " \u2018" + data.tokens[kj] + "\u2019 the weight " +
        number(region.weights[i * nc + j]) + ".";
    });
    return api;
  }

  function tokenChips(box, tokens, prompt) {
    var fragment = document.createDocumentFragment(), chips = [];
    tokens.forEach(function (token, i) {
      var chip = document.createElement("span");
      chip.className = "token" + (prompt === null ? "" : (i < prompt ? " prompt" : " generated"));
      chip.textContent = token;
      chip.dataset.index = String(i);
      fragment.appendChild(chip); chips.push(chip);
    });
    box.appendChild(fragment);
    return chips;
  }

  function generation(root, byId, data, weight) {
    var n = data.n, block = data.block;
    var chips = tokenChips(byId("gv-tokens"), data.tokens, data.prompt);
    var strips = byId("gv-layers"), canvases = [];
    data.heads.forEach(function (count, layer) {
      var name = document.createElement("span");
      name.className = "mv-label"; name.textContent = "layer " + layer;
      var canvas = document.createElement("canvas");
      canvas.className = "gv-strip"; canvas.width = n; canvas.height = count; canvas.dataset.layer = String(layer);
      strips.appendChild(name); strips.appendChild(canvas); canvases.push(canvas);
    });
    function choose(position) {  // the generated token at `position`, produced by the query at position - 1
      var row = Math.floor((position - 1) / block), visible = Math.floor((position - 1) / block) + 1;
      canvases.forEach(function (canvas, layer) {
        var count = data.heads[layer], strip = new Float32Array(count * n);
        for (var h = 0; h < count; h++) {
          for (var j = 0; j < visible; j++) strip[h * n + j] = weight(layer, h, row, j);
        }
        paint(canvas, strip, 0, count, n);
      });
      chips.forEach(function (chip, i) { chip.classList.toggle("focus", i === position); });
      var best = null;
      data.heads.forEach(function (count, layer) {
        for (var h = 0; h < count; h++) {
          for (var j = 0; j < visible; j++) {
            var w = weight(layer, h, row, j);
            if (!best || w > best.w) best = { layer: layer, head: h, j: j, w: w };
          }
        }
      });
      var where = block === 1 ? "\u2018" + data.tokens[best.j] + "\u2019" : "tokens " + data.rows[best.j];
      byId("gv-summary").textContent = "Producing \u2018" + data.tokens[position] + "\u2019 (after \u2018" +
        data.tokens[position - 1] + "\u2019): the strongest look is layer " + best.layer + ", head " + best.head +
        " at " + where + " (" + number(best.w) + ").";
      root.dataset.generated = String(position);
    }
    chips.forEach(function (chip, i) {
      if (i >= data.prompt) chip.addEventListener("click", function () { choose(i); });
    });
    choose(data.prompt);
  }
})();
