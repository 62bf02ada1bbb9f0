// Polls the dashboard JSON, fills the tiles and tables, and pushes a point onto each chart.
(function () {
  var root = document.getElementById("dashboard");
  if (!root) return;
  var src = root.getAttribute("data-src"), every = parseInt(root.getAttribute("data-refresh-ms"), 10) || 3000;
  var CLASSES = JSON.parse(root.getAttribute("data-classes"));   // the server's SLA classes, highest first
  var COLORS = ["#d9480f", "#1971c2", "#2f9e44", "#868e96", "#5f3dc4", "#e8590c"];
  var classSeries = CLASSES.map(function (c, i) { return {name: c, color: COLORS[i % COLORS.length]}; });
  var charts = {
    queue: new TinyChart(document.getElementById("c-queue"), classSeries, {label: "queue depth"}),
    tps: new TinyChart(document.getElementById("c-tps"), [{name: "generation", color: "#5f3dc4"}], {label: "tokens per second"}),
    kv: new TinyChart(document.getElementById("c-kv"), [{name: "busiest worker", color: "#e8590c"}], {label: "KV cache use"}),
    ttft: new TinyChart(document.getElementById("c-ttft"), classSeries, {label: "TTFT p99"}),
    seqs: new TinyChart(document.getElementById("c-seqs"), [{name: "running", color: "#1971c2"},
                                                          {name: "waiting", color: "#e8590c"}], {label: "sequences"}),
    e2e: new TinyChart(document.getElementById("c-e2e"), classSeries, {label: "end-to-end p99"})
  };
  function $(id) { return document.getElementById(id); }
  function secs(v) { return v === null || v === undefined ? "—" : v < 1 ? Math.round(v * 1000) + " ms" : v.toFixed(2) + " s"; }
  function pct(v) { return v === null || v === undefined ? "—" : (v * 100).toFixed(1) + "%"; }
  function num(v) { return v === null || v === undefined ? "—" : Math.round(v).toLocaleString(); }
  function cell(text, cls, label) {
    var td = document.createElement("td"); td.textContent = text;
    if (cls) td.className = cls;
    if (label) td.setAttribute("data-label", label);
    return td;
  }
  var WORKER_COLS = ["Worker", "By class", "Running", "Waiting", "KV cache", "Tokens/s", "Preemptions", "Updated"];

  function seed(points) {   // the ledger's last minutes, so the charts do not start empty on every load; the
    points.forEach(function (p) {   // charts the ledger has no history for get empty points at the same times,
      charts.queue.push(p.ts, CLASSES.map(function () { return null; }));   // so every chart spans one window
      charts.kv.push(p.ts, [null]);
      charts.seqs.push(p.ts, [null, null]);
      charts.tps.push(p.ts, [p.tokens_per_s]);
      charts.ttft.push(p.ts, CLASSES.map(function (c) { return p.ttft_p99[c]; }));
      charts.e2e.push(p.ts, CLASSES.map(function (c) { return p.e2e_p99[c]; }));
    });
  }

  function render(d) {
    if (d.history) seed(d.history);
    $("t-tps").textContent = d.tokens_per_s.toFixed(1);
    $("t-tps-src").textContent = "from " + d.tokens_per_s_source;
    $("t-kv").textContent = pct(d.kv_cache_usage);
    $("t-prefix").textContent = pct(d.prefix_cache_hit_rate);
    $("t-preempt").textContent = num(d.preemptions);
    $("t-finished").textContent = num(d.jobs_finished_per_min);
    CLASSES.forEach(function (c) {
      var row = document.querySelector('#class-table tr[data-class="' + c + '"]'), lat = d.latency[c];
      var vals = {queue: d.queues ? num(d.queues[c]) : "?", queued: num(d.jobs[c].queued), running: num(d.jobs[c].running),
                  ttft_p50: secs(lat.ttft_p50), ttft_p99: secs(lat.ttft_p99), e2e_p50: secs(lat.e2e_p50),
                  e2e_p99: secs(lat.e2e_p99), n: num(lat.n)};
      row.querySelectorAll("td[data-k]").forEach(function (td) { td.textContent = vals[td.getAttribute("data-k")]; });
    });
    var body = document.querySelector("#worker-table tbody");
    body.replaceChildren();
    if (!d.workers.length) {
      var td = cell("No worker has reported in the last 30 s.", "muted"); td.colSpan = 8;
      var tr = document.createElement("tr"); tr.appendChild(td); body.appendChild(tr);
    }
    d.workers.forEach(function (w) {
      var tr = document.createElement("tr");
      var byClass = CLASSES.filter(function (c) { return w.by_class[c]; }).map(function (c) {
        return c + " " + w.by_class[c].running + "/" + w.by_class[c].waiting;
      }).join(" · ") || "idle";
      [[w.worker + (w.device ? " (" + w.device + ")" : ""), ""], [byClass, "small"], [num(w.running), "num"], [num(w.waiting), "num"],
       [pct(w.kv_cache_usage), "num"], [w.generation_tokens_per_s.toFixed(1), "num"], [num(w.preemptions), "num"],
       [w.age_s + " s ago", "num"]].forEach(function (c, i) { tr.appendChild(cell(c[0], c[1], WORKER_COLS[i])); });
      body.appendChild(tr);
    });
    charts.queue.push(d.ts, CLASSES.map(function (c) { return d.queues ? d.queues[c] : null; }));
    charts.tps.push(d.ts, [d.tokens_per_s]);
    charts.kv.push(d.ts, [d.kv_cache_usage === null ? null : d.kv_cache_usage * 100]);
    charts.ttft.push(d.ts, CLASSES.map(function (c) { return d.latency[c].ttft_p99; }));
    charts.e2e.push(d.ts, CLASSES.map(function (c) { return d.latency[c].e2e_p99; }));
    var sum = function (k) { return d.workers.reduce(function (a, w) { return a + w[k]; }, 0); };
    charts.seqs.push(d.ts, d.workers.length ? [sum("running"), sum("waiting")] : [null, null]);
    var err = $("dash-error");
    if (d.errors.length) { err.textContent = d.errors.join(" · "); err.classList.remove("hidden"); }
    else { err.classList.add("hidden"); }
    $("updated").textContent = "updated " + new Date(d.ts * 1000).toLocaleTimeString();
    root.setAttribute("data-loaded", "1");
  }

  var first = true;
  function tick() {
    var url = first ? src + "?history=1" : src;
    first = false;
    fetch(url, {credentials: "same-origin", headers: {Accept: "application/json"}})
      .then(function (r) {
        if (r.status === 401) { window.location.reload(); throw new Error("signed out"); }
        if (!r.ok) throw new Error("HTTP " + r.status);
        return r.json();
      })
      .then(render)
      .catch(function (e) {
        var err = $("dash-error");
        err.textContent = "Could not refresh the dashboard: " + e.message + ". Retrying…";
        err.classList.remove("hidden");
      })
      .finally(function () { setTimeout(tick, every); });
  }
  tick();
})();
