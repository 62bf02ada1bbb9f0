// A tiny SVG time-series chart: TinyChart(el, [{name, color}]).push(ts, [values]). Keeps the last `max` points.
(function () {
  var NS = "http://www.w3.org/2000/svg";
  function el(tag, attrs, parent) {
    var n = document.createElementNS(NS, tag);
    for (var k in attrs) n.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(n);
    return n;
  }
  function fmt(v) {
    if (v === null || v === undefined || isNaN(v)) return "—";
    if (Math.abs(v) >= 1000) return (v / 1000).toFixed(1) + "k";
    if (Math.abs(v) >= 10) return v.toFixed(0);
    return (Math.round(v * 100) / 100).toString();
  }
  function TinyChart(container, series, opts) {
    opts = opts || {};
    this.series = series; this.max = opts.max || 60; this.points = [];
    this.w = 320; this.h = 120; this.pad = {l: 34, r: 6, t: 8, b: 16};
    this.svg = el("svg", {viewBox: "0 0 " + this.w + " " + this.h, role: "img", "class": "tinychart",
                          "aria-label": opts.label || "chart"}, container);
    this.grid = el("g", {"class": "grid"}, this.svg);
    this.lines = series.map(function (s) {
      return el("polyline", {fill: "none", stroke: s.color, "stroke-width": 2, "stroke-linejoin": "round"}, this.svg);
    }, this);
    var legend = document.createElement("div"); legend.className = "legend";
    this.values = series.map(function (s) {
      var item = document.createElement("span");
      var sw = document.createElement("i"); sw.className = "sw"; sw.setAttribute("data-color", s.color);
      sw.appendChild(document.createTextNode("\u25A0"));
      item.appendChild(sw); item.appendChild(document.createTextNode(" " + s.name + " "));
      var b = document.createElement("b"); b.textContent = "—"; item.appendChild(b);
      legend.appendChild(item);
      return b;
    });
    container.appendChild(legend);
    // Colour the legend swatches through the SVG presentation attribute (no inline styles under the CSP).
    legend.querySelectorAll("i.sw").forEach(function (sw) {
      var svg = el("svg", {width: 10, height: 10, "class": "swatch"});
      el("rect", {width: 10, height: 10, fill: sw.getAttribute("data-color")}, svg);
      sw.replaceWith(svg);
    });
  }
  TinyChart.prototype.push = function (ts, vals) {
    this.points.push({t: ts, v: vals});
    if (this.points.length > this.max) this.points.shift();
    this.draw();
    vals.forEach(function (v, i) { this.values[i].textContent = fmt(v); }, this);
  };
  TinyChart.prototype.draw = function () {
    var p = this.pad, w = this.w - p.l - p.r, h = this.h - p.t - p.b, pts = this.points;
    var top = 0;
    pts.forEach(function (pt) { pt.v.forEach(function (v) { if (v !== null && v > top) top = v; }); });
    top = top > 0 ? top * 1.1 : 1;
    while (this.grid.firstChild) this.grid.removeChild(this.grid.firstChild);
    [0, 0.5, 1].forEach(function (f) {
      var y = p.t + h - f * h;
      el("line", {x1: p.l, x2: p.l + w, y1: y, y2: y, "class": "gridline"}, this.grid);
      el("text", {x: p.l - 4, y: y + 3, "text-anchor": "end", "class": "axis"}, this.grid).textContent = fmt(top * f);
    }, this);
    if (pts.length) {
      var span = Math.max(1, pts[pts.length - 1].t - pts[0].t);
      el("text", {x: p.l, y: this.h - 3, "class": "axis"}, this.grid).textContent = "-" + Math.round(span) + "s";
      el("text", {x: p.l + w, y: this.h - 3, "text-anchor": "end", "class": "axis"}, this.grid).textContent = "now";
    }
    var t0 = pts.length ? pts[0].t : 0, tspan = pts.length > 1 ? pts[pts.length - 1].t - t0 : 1;
    this.lines.forEach(function (line, i) {
      var coords = [];
      pts.forEach(function (pt) {
        var v = pt.v[i];
        if (v === null || v === undefined) return;
        var x = pts.length > 1 ? p.l + (pt.t - t0) / tspan * w : p.l + w;
        coords.push(x.toFixed(1) + "," + (p.t + h - v / top * h).toFixed(1));
      });
      if (coords.length === 1) coords.unshift(coords[0].replace(/^[^,]+/, p.l.toFixed(1)));  // one point: a level line
      line.setAttribute("points", coords.join(" "));
    });
  };
  window.TinyChart = TinyChart;
})();
