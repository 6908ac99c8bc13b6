// attnlab explain report, trained-model section: the head view (layer selector, head toggles,
// hover a word to see its lines). Inlined; no network. Lines carry data-layer/-head/-query/-key/-weight.
// Each root [data-attnlab-heads] is set up once; its ids start with its data-prefix.
(function () {
  "use strict";
  document.querySelectorAll("[data-attnlab-heads]").forEach(function (root) {
    if (root.dataset.headsReady) return;
    root.dataset.headsReady = "1";
    init(root);
  });

  function init(root) {
    var prefix = root.dataset.prefix || "";
    function byId(name) { return document.getElementById(prefix + name); }
    var node = byId("attnlab-trained");
    if (!node) return;
    var data = JSON.parse(node.textContent);
    var svg = byId("hv-svg");
    var layerSelect = byId("hv-layer");
    var NS = "http://www.w3.org/2000/svg";
    var state = { layer: data.layer, query: data.focus, preview: null };

    function heads() {  // the ticked heads that the shown layer has (layers may have fewer heads)
      return [].slice.call(root.querySelectorAll("input.hv-head:checked")).map(function (el) { return Number(el.value); })
        .filter(function (h) { return h < data.weights[state.layer].length; });
    }
    function hidden(i) { return data.hide_special && data.special[i]; }
    function links(h, q, fn) {  // a query's drawable links, stored as [key, weight, key, weight, ...]
      var row = data.weights[state.layer][h][q];
      for (var i = 0; i < row.length; i += 2) fn(row[i + 1], row[i]);
    }
    function y(i) { return data.top + i * data.row; }

    function draw() {
      var group = byId("hv-lines");
      while (group.firstChild) group.removeChild(group.firstChild);
      var q = state.preview === null ? state.query : state.preview, shown = heads();
      var scale = 1 / Math.sqrt(Math.max(1, shown.length));
      shown.forEach(function (h) {
        if (hidden(q)) return;
        links(h, q, function (w, k) {
          if (hidden(k) || w * scale < data.min_alpha) return;
          var line = document.createElementNS(NS, "line");
          line.setAttribute("x1", data.left); line.setAttribute("x2", data.right);
          line.setAttribute("y1", y(q)); line.setAttribute("y2", y(k));
          line.setAttribute("stroke", data.colors[h % data.colors.length]);
          line.setAttribute("stroke-width", "2.5");
          line.setAttribute("stroke-opacity", (w * scale).toFixed(4));
          line.setAttribute("class", "hv-line");
          line.dataset.layer = state.layer; line.dataset.head = h; line.dataset.query = q; line.dataset.key = k;
          line.dataset.weight = w.toFixed(4);
          group.appendChild(line);
        });
      });
      root.querySelectorAll(".hv-word.q").forEach(function (el) {
        el.classList.toggle("focus", Number(el.dataset.index) === q);
      });
      var best = byId("hv-best");
      if (best) best.textContent = describe(q, shown);
    }

    function describe(q, shown) {
      var top = null;
      shown.forEach(function (h) {
        links(h, q, function (w, k) {
          if (k === q || hidden(k)) return;
          if (!top || w > top.w) top = { h: h, k: k, w: w };
        });
      });
      if (!top) return "";
      return "Layer " + state.layer + ": \u2018" + data.words[q] + "\u2019 is linked most strongly to \u2018" +
        data.words[top.k] + "\u2019 by head " + top.h + " (" + top.w.toFixed(3) + ").";
    }

    function showToggles() {  // a layer with fewer heads hides the toggles of the heads it lacks
      var count = data.weights[state.layer].length;
      root.querySelectorAll("input.hv-head").forEach(function (el) {
        el.parentNode.hidden = Number(el.value) >= count;
      });
    }

    layerSelect.addEventListener("change", function () {
      state.layer = Number(layerSelect.value); showToggles(); draw();
    });
    root.querySelectorAll("input.hv-head").forEach(function (el) { el.addEventListener("change", draw); });
    root.querySelectorAll(".hv-word.q").forEach(function (el) {
      var i = Number(el.dataset.index);
      el.addEventListener("mouseenter", function () { state.preview = i; draw(); });
      el.addEventListener("mouseleave", function () { state.preview = null; draw(); });
      el.addEventListener("click", function () { state.query = i; state.preview = null; draw(); });
    });
    showToggles();
    draw();
  }
})();
