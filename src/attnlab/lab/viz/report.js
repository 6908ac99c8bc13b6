// attnlab explain report and walk views: head selector, token focus and hover highlighting. Inlined; no
// network. Each root [data-attnlab-walk] (the report's <body>, or one inline view) is set up once; its ids
// start with its data-prefix, so several views share a page.
(function () {
  "use strict";
  document.querySelectorAll("[data-attnlab-walk]").forEach(function (root) {
    if (root.dataset.walkReady) return;
    root.dataset.walkReady = "1";
    init(root);
  });

  function init(root) {
    var prefix = root.dataset.prefix || "";
    function byId(name) { return document.getElementById(prefix + name); }
    var data = JSON.parse(byId("attnlab-data").textContent);
    var select = byId("head-select");
    var state = { head: 0, focus: data.focus, preview: null };

    function fmt(x) { return x.toFixed(4); }
    function allowed(i, j) { return !data.allowed || data.allowed[i][j]; }

    function ranked(i) {
      var row = data.weights[state.head][i], keys = [];
      for (var j = 0; j < row.length; j++) { if (allowed(i, j)) keys.push(j); }
      keys.sort(function (a, b) { return row[b] - row[a] || a - b; });
      return keys.map(function (j) { return { j: j, w: row[j] }; });
    }

    function renderLinks(i) {
      var links = ranked(i), word = data.tokens[i];
      var top = links[0], low = links[links.length - 1];
      var summary = byId("links-summary");
      summary.innerHTML = "";
      var parts = ["\u2018", word, "\u2019 attends most to \u2018", data.context_tokens[top.j], "\u2019 (", fmt(top.w),
        ") and least to \u2018", data.context_tokens[low.j], "\u2019 (", fmt(low.w), ")."];
      parts.forEach(function (text, k) {
        var node = (k === 1 || k === 3 || k === 7) ? document.createElement("b") : document.createTextNode(text);
        if (node.nodeType === 1) node.textContent = text;
        summary.appendChild(node);
      });
      var list = byId("links-list");
      list.innerHTML = "";
      var max = top.w || 1;
      links.slice(0, data.max_links).forEach(function (link) {
        var li = document.createElement("li");
        li.innerHTML = '<span class="word"></span><span class="bar"><span></span></span><span class="val"></span>';
        li.querySelector(".word").textContent = data.context_tokens[link.j];
        li.querySelector(".bar span").style.width = (100 * link.w / max).toFixed(1) + "%";
        li.querySelector(".val").textContent = fmt(link.w);
        list.appendChild(li);
      });
      byId("links-word").textContent = word;
      byId("links-head").textContent = data.heads > 1 ? " (head " + state.head + ")" : "";
    }

    function paintTokens(i) {
      var row = data.weights[state.head][i], max = Math.max.apply(null, row) || 1;
      root.querySelectorAll(".token.q").forEach(function (el) {
        el.classList.toggle("focus", Number(el.dataset.index) === i);
        if (data.mode !== "cross") paintKey(el, Number(el.dataset.index));
      });
      if (data.mode === "cross") {
        root.querySelectorAll(".token.k").forEach(function (el) { paintKey(el, Number(el.dataset.index)); });
      }
      function paintKey(el, j) {
        var ok = allowed(i, j);
        el.classList.toggle("blocked", !ok);
        el.style.background = ok ? "rgba(79, 70, 229, " + (0.08 + 0.62 * row[j] / max).toFixed(3) + ")" : "";
        el.style.color = ok && row[j] / max > 0.6 ? "#fff" : "";
        el.querySelector(".w").textContent = ok ? row[j].toFixed(2) : "\u2013";
        el.querySelector(".w").style.color = ok && row[j] / max > 0.6 ? "#fff" : "";
      }
    }

    function highlightRow(i) {
      var r = Math.floor(i / data.block[0]);
      root.querySelectorAll("svg.heatmap rect.cell").forEach(function (el) {
        el.classList.toggle("hl", Number(el.dataset.row) === r);
      });
      root.querySelectorAll("svg.heatmap .row-label").forEach(function (el) {
        el.classList.toggle("hl", Number(el.dataset.row) === r);
      });
      root.querySelectorAll("table.values tr[data-row]").forEach(function (el) {
        el.classList.toggle("hl", Number(el.dataset.row) === i);
      });
    }

    function show(i) { paintTokens(i); highlightRow(i); renderLinks(i); }
    function current() { return state.preview === null ? state.focus : state.preview; }

    function showHead(h) {
      state.head = Number(h);
      root.querySelectorAll(".per-head").forEach(function (el) {
        el.hidden = Number(el.dataset.head) !== state.head;
      });
      root.dataset.activeHead = String(state.head);
      show(current());
    }

    if (select) select.addEventListener("change", function () { showHead(select.value); });
    root.querySelectorAll(".token.q").forEach(function (el) {
      var i = Number(el.dataset.index);
      el.addEventListener("mouseenter", function () { state.preview = i; show(i); });
      el.addEventListener("mouseleave", function () { state.preview = null; show(state.focus); });
      el.addEventListener("click", function () {
        state.focus = i; state.preview = null; show(i);
        byId("pinned").textContent = data.tokens[i];
      });
    });
    root.querySelectorAll("svg.heatmap [data-row]").forEach(function (el) {
      var i = Math.min(Number(el.dataset.row) * data.block[0], data.tokens.length - 1);
      el.addEventListener("mouseenter", function () { state.preview = i; show(i); });
      el.addEventListener("mouseleave", function () { state.preview = null; show(state.focus); });
    });
    showHead(select ? select.value : 0);
  }
})();
