/* entoscope inspect: every head's attention as small multiples (layers x heads); a click enlarges one head into a
   token-to-token view (queries down, keys across, the tokens as labels) and a strip of the prompt's tokens
   coloured by the attention of one query (click a token or a row to choose it). Masked cells: keys after the
   query (grey) and, on sliding-window layers, keys outside the window (orange). Data: the page's JSON (float32
   weights, base64, each head's lower triangle row by row). No network, no library. */
(function () {
  "use strict";
  if (window.entoscopeInspect) return;
  var BLUE = [8, 81, 156], FUTURE = [240, 240, 240], OUTSIDE = [253, 221, 182];

  function mix(w) {
    var t = Math.max(0, Math.min(1, w));
    return [Math.round(255 + (BLUE[0] - 255) * t), Math.round(255 + (BLUE[1] - 255) * t),
            Math.round(255 + (BLUE[2] - 255) * t)];
  }
  function css(rgb) { return "rgb(" + rgb[0] + "," + rgb[1] + "," + rgb[2] + ")"; }
  function floats(b64) {
    var bin = atob(b64), bytes = new Uint8Array(bin.length);
    for (var i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    return new Float32Array(bytes.buffer);
  }
  function shown(tok) { return tok.replace(/ /g, "\u2423"); }
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function View(root, d) {
    this.root = root; this.d = d; this.T = d.T; this.L = d.n_layers; this.H = d.n_heads;
    this.w = floats(d.attention); this.tri = this.T * (this.T + 1) / 2;
    this.local = {};
    var self = this;
    (d.window ? d.window.layers : []).forEach(function (l) { self.local[l] = true; });
    this.layer = d.first[0]; this.head = d.first[1]; this.query = this.T - 1; this.canvases = [];
  }
  View.prototype.at = function (l, h, q, k) {
    return k > q ? 0 : this.w[(l * this.H + h) * this.tri + q * (q + 1) / 2 + k];
  };
  View.prototype.seen = function (l, q, k) {
    return k <= q && (!this.local[l] || q - k < this.d.window.size);
  };
  View.prototype.rgb = function (l, h, q, k) {
    if (k > q) return FUTURE;
    if (!this.seen(l, q, k)) return OUTSIDE;
    return mix(this.at(l, h, q, k));
  };
  View.prototype.name = function (l, h) { return "a" + l + ".h" + h; };
  View.prototype.tok = function (i) { return "'" + shown(this.d.tokens[i]) + "'"; };

  View.prototype.thumb = function (canvas, l, h) {
    var T = this.T, n = Math.min(T, 64), ctx = canvas.getContext("2d"), img = ctx.createImageData(n, n);
    for (var i = 0; i < n; i++) {
      var q0 = Math.floor(i * T / n), q1 = Math.max(q0 + 1, Math.floor((i + 1) * T / n));
      for (var j = 0; j < n; j++) {
        var k0 = Math.floor(j * T / n), k1 = Math.max(k0 + 1, Math.floor((j + 1) * T / n));
        var best = -1, future = true;
        for (var q = q0; q < q1; q++) for (var k = k0; k < k1; k++) {
          if (k <= q) future = false;
          if (this.seen(l, q, k)) best = Math.max(best, this.at(l, h, q, k));
        }
        var c = best >= 0 ? mix(best) : future ? FUTURE : OUTSIDE, o = 4 * (i * n + j);
        img.data[o] = c[0]; img.data[o + 1] = c[1]; img.data[o + 2] = c[2]; img.data[o + 3] = 255;
      }
    }
    ctx.putImageData(img, 0, 0);
  };

  View.prototype.build = function () {
    var self = this, grid = this.root.querySelector(".esi-heads"), size = this.H > 16 ? 28 : 40;
    var n = Math.min(this.T, 64);
    grid.style.gridTemplateColumns = "auto repeat(" + this.H + ", " + (size + 2) + "px)";
    grid.appendChild(el("div", "esi-lab", ""));
    for (var h = 0; h < this.H; h++) grid.appendChild(el("div", "esi-lab", "h" + h));
    for (var l = 0; l < this.L; l++) {
      var lab = el("div", "esi-lab" + (this.local[l] ? " esi-local" : ""), "L" + l + (this.local[l] ? " \u25e7" : ""));
      if (this.local[l]) lab.title = "layer " + l + ": sliding window of " + this.d.window.size + " tokens";
      grid.appendChild(lab);
      this.canvases.push([]);
      for (h = 0; h < this.H; h++) {
        var c = document.createElement("canvas");
        c.width = n; c.height = n; c.style.width = size + "px"; c.style.height = size + "px";
        c.title = this.name(l, h) + (this.local[l] ? " (sliding window)" : "");
        c.addEventListener("click", (function (ll, hh) { return function () { self.select(ll, hh); }; })(l, h));
        this.thumb(c, l, h);
        grid.appendChild(c);
        this.canvases[l].push(c);
      }
    }
    this.matrix = this.root.querySelector("canvas.esi-matrix");
    this.matrix.addEventListener("mousemove", function (e) { self.hover(e); });
    this.matrix.addEventListener("mouseleave", function () { self.readout(""); });
    this.matrix.addEventListener("click", function (e) {
      var cell = self.cell(e);
      if (cell) { self.query = cell[0]; self.draw(); }
    });
  };

  View.prototype.select = function (l, h) {
    var old = this.canvases[this.layer] && this.canvases[this.layer][this.head];
    if (old) old.classList.remove("esi-on");
    this.layer = l; this.head = h;
    this.canvases[l][h].classList.add("esi-on");
    this.draw();
  };

  View.prototype.readout = function (text) { this.root.querySelector(".esi-readout").textContent = text; };

  View.prototype.draw = function () {
    var self = this, l = this.layer, h = this.head, T = this.T, d = this.d;
    var title = this.name(l, h) + ": layer " + l + ", head " + h;
    if (this.local[l]) title += "; sliding window: each query sees its last " + d.window.size + " tokens";
    var dla = d.dla && d.dla[l + "." + h];
    if (dla !== undefined) title += "; direct contribution to " + d.dla_label + " " + (dla >= 0 ? "+" : "") + dla.toFixed(3);
    this.root.querySelector(".esi-detail-title").textContent = title;
    var strip = this.root.querySelector(".esi-strip");
    strip.textContent = "";
    var q = this.query;
    strip.appendChild(el("span", "esi-note", "attention of " + this.tok(q) + " (position " + q + ") to:")).style.border = "none";
    for (var k = 0; k < T; k++) {
      var s = el("span", k === q ? "esi-q" : "", shown(d.tokens[k]));
      var w = this.at(l, h, q, k);
      if (k <= q) {
        s.style.background = css(this.rgb(l, h, q, k));
        if (this.seen(l, q, k) && w > 0.55) s.style.color = "#fff";
        s.title = "position " + k + ": " + (this.seen(l, q, k) ? w.toFixed(4) : "outside the sliding window");
      } else {
        s.style.color = "#aaa";
        s.title = "position " + k + ": after the query (masked)";
      }
      s.addEventListener("click", (function (kk) { return function () { self.query = kk; self.draw(); }; })(k));
      strip.appendChild(s);
    }
    this.drawMatrix();
  };

  View.prototype.geometry = function () {
    var T = this.T, c = Math.max(6, Math.min(24, Math.floor(560 / T)));
    var ctx = this.matrix.getContext("2d");
    ctx.font = "11px ui-monospace, SFMono-Regular, Menlo, monospace";
    var widest = 0;
    for (var i = 0; i < T; i++) widest = Math.max(widest, ctx.measureText(this.label(i)).width);
    var margin = Math.min(140, Math.ceil(widest) + 8);
    return {c: c, left: margin, top: margin, every: Math.max(1, Math.ceil(11 / c))};
  };
  View.prototype.label = function (i) {
    var t = shown(this.d.tokens[i]);
    return (t.length > 14 ? t.slice(0, 13) + "\u2026" : t) + " " + i;
  };

  View.prototype.drawMatrix = function () {
    var l = this.layer, h = this.head, T = this.T, g = this.geometry(), m = this.matrix;
    var width = g.left + T * g.c + 4, height = g.top + T * g.c + 4, ratio = window.devicePixelRatio || 1;
    m.width = Math.round(width * ratio); m.height = Math.round(height * ratio);
    m.style.width = width + "px"; m.style.height = height + "px";
    var ctx = m.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    ctx.font = "11px ui-monospace, SFMono-Regular, Menlo, monospace";
    ctx.fillStyle = "#333";
    ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    for (var q = 0; q < T; q += g.every) ctx.fillText(this.label(q), g.left - 4, g.top + (q + 0.5) * g.c);
    for (var k = 0; k < T; k += g.every) {
      ctx.save();
      ctx.translate(g.left + (k + 0.5) * g.c, g.top - 4);
      ctx.rotate(-Math.PI / 2);
      ctx.textAlign = "left";
      ctx.fillText(this.label(k), 0, 0);
      ctx.restore();
    }
    for (q = 0; q < T; q++) for (k = 0; k < T; k++) {
      ctx.fillStyle = css(this.rgb(l, h, q, k));
      ctx.fillRect(g.left + k * g.c, g.top + q * g.c, g.c, g.c);
    }
    ctx.strokeStyle = "#dd6b20"; ctx.lineWidth = 2;
    ctx.strokeRect(g.left + 1, g.top + this.query * g.c + 1, T * g.c - 2, g.c - 2);
    ctx.strokeStyle = "#bbb"; ctx.lineWidth = 1;
    ctx.strokeRect(g.left - 0.5, g.top - 0.5, T * g.c + 1, T * g.c + 1);
    this.g = g;
  };

  View.prototype.cell = function (e) {
    if (!this.g) return null;
    var r = this.matrix.getBoundingClientRect(), x = e.clientX - r.left - this.g.left, y = e.clientY - r.top - this.g.top;
    var k = Math.floor(x / this.g.c), q = Math.floor(y / this.g.c);
    return (q >= 0 && k >= 0 && q < this.T && k < this.T) ? [q, k] : null;
  };

  View.prototype.hover = function (e) {
    var cell = this.cell(e);
    if (!cell) { this.readout(""); return; }
    var q = cell[0], k = cell[1], l = this.layer, h = this.head, what;
    if (k > q) what = "after the query (masked)";
    else if (!this.seen(l, q, k)) what = "outside the sliding window (masked)";
    else what = this.at(l, h, q, k).toFixed(4);
    this.readout(this.name(l, h) + "  query " + q + " " + this.tok(q) + " \u2192 key " + k + " " + this.tok(k) + ": " + what);
  };

  window.entoscopeInspect = function (id) {
    var root = document.getElementById(id);
    if (!root || root.getAttribute("data-ready")) return;
    root.setAttribute("data-ready", "1");
    var data = JSON.parse(document.getElementById(id + "-data").textContent);
    var view = new View(root, data);
    var fallback = root.querySelector(".esi-nojs");
    if (fallback) fallback.style.display = "none";
    view.build();
    view.select(view.layer, view.head);
  };
})();
