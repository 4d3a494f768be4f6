/* lorascope report: draws the charts from the JSON embedded in the page.
 * Strings from the run reach the page only as canvas text, through esc() in tooltips, or as
 * text nodes (the heatmaps' hover).
 * Each drawn chart gets data-points (how many data points it shows); window.lorascopeReport
 * lists the charts once all are drawn, with the milliseconds each took and the option each
 * was given, and <body> gets data-charts-drawn (the browser tests and
 * benchmarks/report_scale.py wait for it). */
(function () {
  "use strict";
  var startedMs = Math.round(performance.now());
  var data = JSON.parse(document.getElementById("report-data").textContent);
  var RANK0 = "#d62728";
  var PALETTE = ["#1f77b4", "#2ca02c", "#9467bd", "#17becf", "#8c564b", "#7f7f7f", "#bcbd22", "#e377c2", "#ff7f0e", "#3f51b5"];
  var STATUS_NAMES = ["done", "pending", "error", "never called"];
  var charts = {};
  var options = {};

  function esc(s) {
    return String(s).replace(/[&<>"']/g, function (c) {
      return { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c];
    });
  }
  function rankColor(rank, i) { return rank === 0 ? RANK0 : PALETTE[i % PALETTE.length]; }
  function fmtMiB(v) { return v == null ? "—" : (v >= 1024 ? (v / 1024).toFixed(2) + " GiB" : v.toFixed(1) + " MiB"); }
  function fmtUs(v) { return v >= 1000 ? (v / 1000).toPrecision(3) + " ms" : (v >= 1 ? v.toPrecision(3) : v.toPrecision(2)) + " µs"; }
  function fmtBytes(n) {
    if (n == null) { return "—"; }
    var units = [["GiB", 1073741824], ["MiB", 1048576], ["KiB", 1024]];
    for (var i = 0; i < units.length; i++) { if (n >= units[i][1]) { return (n / units[i][1]).toFixed(1) + " " + units[i][0]; } }
    return n + " B";
  }
  function zoom(axisIndex, view) {
    var at = view ? { startValue: view[0], endValue: view[1] } : {};
    return [Object.assign({ type: "inside", xAxisIndex: axisIndex, filterMode: "none" }, at),
            Object.assign({ type: "slider", xAxisIndex: axisIndex, filterMode: "none", height: 18, bottom: 8 }, at)];
  }
  function yAxis(name, scale) {
    return { type: "value", name: name, nameLocation: "middle", nameGap: 52, scale: !!scale };
  }
  function base(extra) {
    var opt = { animation: false, grid: { left: 72, right: 28, top: 44, bottom: 62, containLabel: false },
                toolbox: { right: 10, feature: { dataZoom: { yAxisIndex: "none" }, restore: {} } },
                legend: { type: "scroll", top: 4, left: 10, right: 90 } };
    for (var k in extra) { if (Object.prototype.hasOwnProperty.call(extra, k)) { opt[k] = extra[k]; } }
    return opt;
  }
  function draw(id, option, points) {
    var el = document.getElementById(id);
    if (!el || !window.echarts) { return; }
    var chart = window.echarts.init(el, null, { renderer: "canvas" });
    chart.setOption(option);
    chart.getZr().flush();  // paint now, so drawMs counts the painting too
    el.setAttribute("data-points", String(points));
    charts[id] = chart;
    options[id] = option;
  }
  // Over this many ranks a per-rank bar or scatter chart is drawn in ECharts' large mode (one
  // path per series, no per-bar style): 1,024 bars draw in a fraction of the time.
  var LARGE = 400;
  function large(series, n) {
    if (n > LARGE) {
      series.forEach(function (s) {
        s.large = true;
        s.largeThreshold = LARGE;
        s.data = s.data.map(function (d) { return d != null && typeof d === "object" ? d.value : d; });
      });
    }
    return series;
  }
  function zip(xs, ys) { return xs.map(function (x, i) { return [x, ys[i]]; }); }
  function count(series) { return series.reduce(function (n, s) { return n + s.data.length; }, 0); }

  function memoryChart(mem, metric) {
    metric = metric || mem.metric;
    var source = metric === mem.metric ? mem.series : mem.others[metric];
    var series = source.map(function (s, i) {
      var color = rankColor(s.rank, i);
      var item = { type: "line", name: "rank " + s.rank, data: zip(s.t, s.mib), showSymbol: false, color: color,
                   lineStyle: { width: s.rank === 0 ? 2.5 : 1.2 }, z: s.rank === 0 ? 10 : 2, emphasis: { focus: "series" } };
      return item;
    });
    // how each rank ended: one scatter series for all ends (cheaper than a marker per line),
    // and pins with a label for the ranks that ended badly
    var ends = source.filter(function (s) { return s.end; });
    var endPoint = function (s) { return { value: [s.end.t, s.end.mib], name: "rank " + s.rank + ": " + s.end.label }; };
    series.push({ type: "scatter", name: "end of rank", symbolSize: 6, color: "#555", z: 11,
                  data: ends.filter(function (s) { return !s.end.bad; }).map(endPoint) });
    // ranks that ended the same way share one label (on the first of them)
    var byLabel = {};
    ends.filter(function (s) { return s.end.bad; }).forEach(function (s) {
      (byLabel[s.end.label] = byLabel[s.end.label] || []).push(s.rank);
    });
    series.push({ type: "scatter", name: "ended badly", symbol: "pin", symbolSize: 26, color: RANK0, z: 12,
                  label: { position: "left", fontSize: 10, color: RANK0, backgroundColor: "rgba(255,255,255,0.85)",
                           formatter: function (p) { return p.name; } },
                  data: ends.filter(function (s) { return s.end.bad; }).map(function (s) {
                    var same = byLabel[s.end.label];
                    var point = endPoint(s);
                    point.label = { show: same[0] === s.rank };
                    point.name = (same.length > 1 ? "ranks " + same.join(",") : "rank " + s.rank) + ": " + s.end.label;
                    return point;
                  }) });
    if (series.length) {
      var marks = series[0];
      marks.markLine = { silent: true, symbol: "none", animation: false,
        lineStyle: { type: "dashed", color: "#bbb", width: 1 },
        label: { position: "end", fontSize: 9, color: "#888", formatter: function (p) { return p.name; } },
        data: mem.steps.map(function (s, i) {
          var every = Math.ceil(mem.steps.length / 8);  // label a few, so labels do not pile up
          return { xAxis: s[0], name: "step " + s[1], label: { show: i % every === 0 || i === mem.steps.length - 1 } };
        }) };
      marks.markArea = { silent: true, animation: false,
        label: { position: "insideTop", fontSize: 10, formatter: function (p) { return p.name; } },
        data: mem.phases.map(function (p) {
          var color = p.name === "eval" ? "rgba(255,193,7,0.18)" : (p.name === "save" ? "rgba(76,175,80,0.18)" : "rgba(156,39,176,0.15)");
          return [{ xAxis: p.from, name: p.name + (p.open ? " (never ended)" : "") + " r" + p.ranks.join(","), itemStyle: { color: color } }, { xAxis: p.to }];
        }) };
    }
    draw("chart-memory", base({
      tooltip: { trigger: "axis", confine: true, formatter: function (ps) {
        if (!ps.length) { return ""; }
        var rows = ps.slice().sort(function (a, b) { return b.value[1] - a.value[1]; }).slice(0, 12);
        return esc(ps[0].value[0].toFixed(2) + " s") + "<br>" + rows.map(function (p) {
          var who = p.seriesType === "scatter" ? p.name : p.seriesName;
          return p.marker + esc(who) + ": " + esc(fmtMiB(p.value[1]));
        }).join("<br>");
      } },
      xAxis: { type: "value", name: "seconds since start", nameLocation: "middle", nameGap: 26, min: 0, max: "dataMax" },
      yAxis: yAxis(metric + " (MiB)"),
      dataZoom: zoom(0, mem.view),
      series: series
    }), count(series));
    var el = document.getElementById("chart-memory");
    if (el) { el.setAttribute("data-metric", metric); }
  }

  // One button per figure the run recorded; the chart opens on the one the detectors use.
  function memorySwitch(mem) {
    var box = document.getElementById("memory-metrics");
    var bands = data.spread && !data.spread.lines;
    var metrics = (mem.metrics || []).filter(function (m) { return !bands || data.spread.memory[m]; });
    if (!box || metrics.length < 2) { return; }
    metrics.forEach(function (m) {
      var b = document.createElement("button");
      b.type = "button";
      b.setAttribute("data-metric", m);
      b.textContent = m + (m === mem.metric ? " (what the verdict used)" : "");
      if (m === mem.metric) { b.className = "active"; }
      b.addEventListener("click", function () {
        if (charts["chart-memory"]) { charts["chart-memory"].dispose(); delete charts["chart-memory"]; }
        if (bands) { memoryBands(mem, data.spread, m); } else { memoryChart(mem, m); }
        Array.prototype.forEach.call(box.querySelectorAll("button"), function (o) {
          o.className = o === b ? "active" : "";
        });
      });
      box.appendChild(b);
    });
  }

  function peakChart(peak) {
    var cats = peak.ranks.map(function (r) { return "rank " + r; });
    var series = [];
    if (peak.breakdown) {
      Object.keys(peak.breakdown).forEach(function (cat) {
        series.push({ type: "bar", name: cat, stack: "peak", data: peak.breakdown[cat] });
      });
      series.push({ type: "scatter", name: peak.metric, data: peak.peak, symbol: "diamond", symbolSize: 12, color: "#000" });
    } else {
      series.push({ type: "bar", name: peak.metric, data: peak.peak.map(function (v, i) {
        return { value: v, itemStyle: { color: peak.ranks[i] === 0 ? RANK0 : "#5b8fd1" } };
      }), markLine: peak.median_others == null ? undefined : { symbol: "none", silent: true,
        data: [{ yAxis: peak.median_others, name: "median of other ranks" }],
        label: { formatter: function () { return "median of other ranks"; }, position: "insideEndTop" },
        lineStyle: { color: "#333", type: "dashed" } } });
    }
    if (peak.reserved) { series.push({ type: "bar", name: "CUDA max reserved", data: peak.reserved, color: "#b0bec5" }); }
    if (peak.largest_logits) { series.push({ type: "bar", name: "largest logits tensor", data: peak.largest_logits, color: "#ff9800" }); }
    draw("chart-peak", base({
      tooltip: { trigger: "axis", formatter: function (ps) {
        return esc(ps[0].name) + "<br>" + ps.map(function (p) {
          var v = p.value && typeof p.value === "object" ? p.value.value : p.value;
          return p.marker + esc(p.seriesName) + ": " + esc(fmtMiB(v));
        }).join("<br>");
      } },
      toolbox: { show: false },
      xAxis: { type: "category", data: cats },
      yAxis: yAxis("MiB"),
      dataZoom: cats.length > 16 ? zoom(0) : [],
      series: large(series, cats.length)
    }), peak.peak.filter(function (v) { return v != null; }).length);
  }

  function collectivesChart(col) {
    var el = document.getElementById("chart-collectives");
    if (!el) { return; }
    el.style.height = Math.max(240, col.rows.length * 22 + 120) + "px";
    var ranks = col.rows;  // a rank, or ranks whose calls read alike ("ranks 1-63 (63)")
    var series = col.ops.map(function (op, i) {
      return { type: "scatter", name: op, symbol: "rect", symbolSize: [14, 14], color: PALETTE[i % PALETTE.length],
               data: col.cells.filter(function (c) { return c[2] === i; }) };
    });
    series.push({ type: "scatter", name: "never called", symbol: "rect", symbolSize: [14, 14], color: "#e0e0e0",
                  data: col.cells.filter(function (c) { return c[3] === 3; }) });
    series.push({ type: "scatter", name: "pending", symbol: "emptyRect", symbolSize: [20, 20], color: RANK0, z: 5,
                  itemStyle: { borderWidth: 3 }, data: col.cells.filter(function (c) { return c[3] === 1; }) });
    series.push({ type: "scatter", name: "error", symbol: "triangle", symbolSize: 12, color: "#000", z: 6,
                  data: col.cells.filter(function (c) { return c[3] === 2; }) });
    if (col.first) {
      series[0].markArea = { silent: true, itemStyle: { color: "rgba(214,39,40,0.16)" },
        label: { position: "top", color: RANK0, formatter: function () { return "first disagreement #" + col.first.seq; } },
        data: [[{ xAxis: col.first.seq - 0.5 }, { xAxis: col.first.seq + 0.5 }]] };
    }
    draw("chart-collectives", base({
      tooltip: { trigger: "item", formatter: function (p) {
        var c = p.value;
        return esc(ranks[c[1]] + " · #" + c[0]) + "<br>" + esc(c[2] >= 0 ? col.ops[c[2]] : "—") +
          (c[5] != null ? esc(" · " + fmtBytes(c[5])) : "") + "<br>" + esc(STATUS_NAMES[c[3]]) +
          (c[4] != null ? esc(" · " + c[4] + " ms") : "");
      } },
      xAxis: { type: "value", name: "sequence number", nameLocation: "middle", nameGap: 26,
               min: col.window[0] - 1, max: col.window[1] + 1, minInterval: 1 },
      yAxis: { type: "category", data: ranks, inverse: true },
      dataZoom: zoom(0),
      series: series
    }), col.cells.length);
  }

  function opTimesChart(ops) {
    var rows = ops.rows;
    var names = rows.map(function (r) { return r.op; });
    var mk = function (key, name, color) {
      return { type: "bar", name: name, color: color, data: rows.map(function (r) { return r[key]; }) };
    };
    var series = [mk("min", "fastest rank", "#90caf9"), mk("median", "median rank", "#1e88e5"), mk("max", "slowest rank", "#0d47a1")];
    draw("chart-collective-ops", base({
      tooltip: { trigger: "axis", formatter: function (ps) {
        var r = rows[ps[0].dataIndex];
        return esc(r.op + " · " + r.calls + " calls") + "<br>" +
          esc("fastest: rank " + r.min_rank + " " + r.min.toFixed(3) + " s") + "<br>" +
          esc("median: " + r.median.toFixed(3) + " s") + "<br>" +
          esc("slowest: rank " + r.max_rank + " " + r.max.toFixed(3) + " s");
      } },
      toolbox: { show: false },
      xAxis: { type: "category", data: names, axisLabel: { rotate: names.length > 6 ? 30 : 0 } },
      yAxis: yAxis("seconds (total per rank)"),
      series: series
    }), rows.length);
  }

  function kernelChart(k) {
    var labels = k.bins.map(function (b) { return fmtUs(b.lo) + "–" + fmtUs(b.hi); });
    var series = [
      { type: "bar", name: "LoRA (lora_A / lora_B)", stack: "n", color: RANK0, data: k.bins.map(function (b) { return b.lora; }) },
      { type: "bar", name: "other", stack: "n", color: "#5b8fd1", data: k.bins.map(function (b) { return b.other; }) }
    ];
    if (k.threshold_bin > 0) {
      series[1].markArea = { silent: true, itemStyle: { color: "rgba(255,152,0,0.12)" },
        label: { position: "insideTop", formatter: function () { return "tiny: under " + fmtUs(k.threshold_us); } },
        data: [[{ xAxis: labels[0] }, { xAxis: labels[k.threshold_bin - 1] }]] };
    }
    draw("chart-kernels", base({
      tooltip: { trigger: "axis", formatter: function (ps) {
        return esc(ps[0].name) + "<br>" + ps.map(function (p) { return p.marker + esc(p.seriesName + ": " + p.value); }).join("<br>");
      } },
      toolbox: { show: false },
      xAxis: { type: "category", data: labels, name: "duration (log-spaced bins)", nameLocation: "middle", nameGap: 40,
               axisLabel: { rotate: 30, fontSize: 10 } },
      yAxis: yAxis("count (all ranks)"),
      grid: { left: 72, right: 28, top: 44, bottom: 72 },
      series: series
    }), k.bins.length);
  }

  function perRankLines(id, list, key, yName, fmt) {
    var series = list.map(function (s, i) {
      return { type: "line", name: "rank " + s.rank, data: zip(s.step, s[key]), showSymbol: s.step.length < 40,
               symbolSize: 4, color: rankColor(s.rank, i), lineStyle: { width: s.rank === 0 ? 2.2 : 1.2 },
               z: s.rank === 0 ? 10 : 2, emphasis: { focus: "series" } };
    });
    draw(id, base({
      tooltip: { trigger: "axis", confine: true, formatter: function (ps) {
        if (!ps.length) { return ""; }
        var rows = ps.slice().sort(function (a, b) { return b.value[1] - a.value[1]; }).slice(0, 12);
        return esc("step " + ps[0].value[0]) + "<br>" + rows.map(function (p) {
          return p.marker + esc(p.seriesName + ": " + fmt(p.value[1]));
        }).join("<br>");
      } },
      xAxis: { type: "value", name: "step", nameLocation: "middle", nameGap: 26, min: "dataMin", max: "dataMax", minInterval: 1 },
      yAxis: yAxis(yName, id === "chart-loss"),  // seconds and MiB from 0: a 2% band is not a cliff
      dataZoom: zoom(0),
      series: series
    }), count(series));
  }

  // Above the lines cutoff: per step range, the spread over ranks as two bands (min–max,
  // p10–p90) and the median, with the outlier ranks (and ranks a finding names) as lines.
  function bandsChart(id, sp, yName, fmt, extra) {
    // columns are equal step ranges: a category axis (stacking, which draws the bands, is by index there)
    var b = sp.bands;
    var at = function (step) {  // the column holding a step
      var lo = 0, hi = b.step.length - 1;
      while (lo < hi) { var mid = (lo + hi + 1) >> 1; if (b.step[mid] <= step) { lo = mid; } else { hi = mid - 1; } }
      return lo;
    };
    var col = function (key) { return b[key]; };
    var diff = function (hi, lo) { return b[hi].map(function (v, i) { return v - b[lo][i]; }); };
    var hidden = { type: "line", showSymbol: false, silent: true, lineStyle: { opacity: 0 } };
    var band = function (name, stack, lower, width, color) {
      return [Object.assign({}, hidden, { name: name, stack: stack, data: lower, color: color }),
              Object.assign({}, hidden, { name: name, stack: stack, data: width, color: color, areaStyle: { color: color, opacity: 1 } })];
    };
    var series = [].concat(
      band("min–max over ranks", "minmax", col("min"), diff("max", "min"), "rgba(91,143,209,0.22)"),
      band("p10–p90 over ranks", "p1090", col("p10"), diff("p90", "p10"), "rgba(91,143,209,0.5)"));
    series.push({ type: "line", name: "median rank", data: col("median"), showSymbol: false, color: "#1f4e8c", lineStyle: { width: 1.6 } });
    var drawn = sp.outliers.map(function (o) { return [o, "outlier, z " + o.z]; }).concat(
      sp.named.map(function (o) { return [o, "named by a finding"]; }));
    drawn.forEach(function (d, i) {
      var o = d[0];
      series.push({ type: "line", name: "rank " + o.rank + " (" + d[1] + ")", showSymbol: o.step.length < 40, symbolSize: 4,
                    data: o.step.map(function (x, k) { return [at(x), o.value[k]]; }),
                    color: o.rank === 0 ? RANK0 : PALETTE[(i + 2) % PALETTE.length], lineStyle: { width: 2 }, z: 10 });
    });
    (extra || []).forEach(function (s) {
      s.data = s.data.map(function (p) { return { value: [at(p.step), p.value[1]], name: p.name }; });
      series.push(s);
    });
    var names = [];
    series.forEach(function (s) { if (names.indexOf(s.name) < 0) { names.push(s.name); } });
    draw(id, base({
      legend: { type: "scroll", top: 4, left: 10, right: 90, data: names.map(function (n) {
        return n.indexOf("over ranks") > 0 ? { name: n, icon: "rect" } : n;
      }) },
      tooltip: { trigger: "axis", confine: true, formatter: function (ps) {
        if (!ps.length) { return ""; }
        var i = ps[0].dataIndex;
        var head = b.step[i] === b.to[i] ? "step " + b.step[i] : "steps " + b.step[i] + "–" + b.to[i];
        var rows = [head + " · " + b.ranks[i] + " ranks",
                    "max: " + fmt(b.max[i]) + " (rank " + b.max_rank[i] + ")", "p90: " + fmt(b.p90[i]),
                    "median: " + fmt(b.median[i]), "p10: " + fmt(b.p10[i]), "min: " + fmt(b.min[i]) + " (rank " + b.min_rank[i] + ")"];
        ps.forEach(function (p) {
          if (p.seriesName.indexOf("rank ") === 0 && Array.isArray(p.value)) { rows.push(p.seriesName + ": " + fmt(p.value[1])); }
        });
        return rows.map(esc).join("<br>");
      } },
      xAxis: { type: "category", boundaryGap: false, data: b.step.map(String), name: sp.width > 1 ? "step (" + sp.width + " per point)" : "step",
               nameLocation: "middle", nameGap: 26 },
      yAxis: yAxis(yName, id === "chart-loss"),  // seconds and MiB from 0: a 2% band is not a cliff
      dataZoom: zoom(0),
      series: series
    }), b.step.length * 5 + drawn.reduce(function (n, d) { return n + d[0].step.length; }, 0));
    var el = document.getElementById(id);
    if (el) { el.setAttribute("data-mode", "bands"); el.setAttribute("data-outliers", sp.outliers.map(function (o) { return o.rank; }).join(",")); }
  }

  // Ranks (rows; consecutive ranks share a row when there are many) by step ranges (columns).
  // A heatmap's cells are painted on one canvas (an image in the chart's grid, painted again
  // on zoom), not as one ECharts element each: at 128 x 58 cells that took 100-250 ms a chart.
  // A cell's colour is its deviation from the median cell (hm.median): neutral grey within
  // +-hm.neutral of it (a healthy run's spread), then blue below and red above, full at +-hm.full.
  var NEUTRAL = [0xee, 0xee, 0xee];
  var ABOVE = [[0xfe, 0xe0, 0xd2], [0xfc, 0x92, 0x72], [0xd6, 0x27, 0x28]];
  var BELOW = [[0xde, 0xeb, 0xf7], [0x6b, 0xae, 0xd6], [0x08, 0x51, 0x9c]];
  function mix(ramp, u) {
    var x = Math.min(Math.max(u, 0), 1) * (ramp.length - 1), i = Math.min(Math.floor(x), ramp.length - 2), f = x - i;
    return ramp[i].map(function (a, j) { return Math.round(a + (ramp[i + 1][j] - a) * f); });
  }
  function deviationColor(hm, v) {
    var d = hm.median ? v / hm.median - 1 : 0, far = Math.abs(d);
    var c = far <= hm.neutral ? NEUTRAL : mix(d > 0 ? ABOVE : BELOW, (far - hm.neutral) / (hm.full - hm.neutral));
    return "rgb(" + c.join(",") + ")";
  }
  function heatmapChart(id, hm, name, fmt) {
    var el = document.getElementById(id);
    if (!el) { return; }
    el.style.height = Math.min(640, Math.max(180, hm.rows.length * 14 + 110)) + "px";
    var rowName = function (r) { return r[0] === r[1] ? "rank " + r[0] : "ranks " + r[0] + "–" + r[1]; };
    var colName = function (c) { return c[0] === c[1] ? "step " + c[0] : "steps " + c[0] + "–" + c[1]; };
    var n = hm.columns.length, rows = hm.rows.length, cells = 0;
    var lo = hm.min, hi = hm.max > hm.min ? hm.max : hm.min + 1e-9, shown = [-Infinity, Infinity];
    var colors = hm.values.map(function (v) { if (v == null) { return null; } cells++; return deviationColor(hm, v); });
    var legend = [];  // the legend's bar, sampled from the same colours
    for (var q = 0; q <= 20; q++) { legend.push(deviationColor(hm, lo + (hi - lo) * q / 20)); }
    function paint(params, api) {
      var box = params.coordSys, ratio = window.devicePixelRatio || 1;
      var origin = api.coord([0, 0]), size = api.size([1, 1]), w = size[0], h = size[1];
      var canvas = document.createElement("canvas");
      canvas.width = Math.max(1, Math.round(box.width * ratio));
      canvas.height = Math.max(1, Math.round(box.height * ratio));
      var ctx = canvas.getContext("2d");
      ctx.scale(ratio, ratio);
      var left = origin[0] - w / 2 - box.x, top = origin[1] - h / 2 - box.y;
      var c0 = Math.max(0, Math.floor(-left / w)), c1 = Math.min(n - 1, Math.ceil((box.width - left) / w));
      for (var r = 0; r < rows; r++) {
        var y = top + r * h;
        for (var c = c0; c <= c1; c++) {
          var k = r * n + c, v = hm.values[k];
          if (v == null || v < shown[0] || v > shown[1]) { continue; }
          ctx.fillStyle = colors[k];
          // cells overlap by a pixel's fraction so that no seam shows between them
          ctx.fillRect(left + c * w, y, w + 0.5, h + 0.5);
        }
      }
      return { type: "image", silent: true, style: { image: canvas, x: box.x, y: box.y, width: box.width, height: box.height } };
    }
    draw(id, base({
      legend: { show: false },
      toolbox: { show: false },
      tooltip: { show: false },
      grid: { left: 96, right: 160, top: 16, bottom: 62 },  // room for the scale's labels, left of its bar
      xAxis: { type: "category", data: hm.columns.map(function (c) { return c[0] === c[1] ? String(c[0]) : c[0] + "–" + c[1]; }),
               name: "step", nameLocation: "middle", nameGap: 26, splitArea: { show: false } },
      yAxis: { type: "category", data: hm.rows.map(rowName), inverse: true, axisLabel: { fontSize: 10 } },
      visualMap: { type: "continuous", min: lo, max: hi, calculable: true, seriesIndex: [],
                   orient: "vertical", right: 40, top: "middle", itemHeight: 120, precision: 3,
                   inRange: { color: legend },
                   formatter: function (v) { return fmt(v); } },
      dataZoom: [{ type: "inside", xAxisIndex: 0, filterMode: "none" },
                 { type: "slider", xAxisIndex: 0, height: 18, bottom: 8, filterMode: "none" }],
      series: [{ type: "custom", id: "cells", name: name, data: [[0, 0]], clip: true, renderItem: paint }]
    }), cells);
    var chart = charts[id];
    if (!chart) { return; }
    // dragging the legend's handles shows only the cells inside its range, as ECharts' own heatmap does
    // (a handle at an end of the scale leaves that side open: cells beyond it are painted full)
    chart.on("datarangeselected", function (e) {
      shown = [e.selected[0] <= lo ? -Infinity : e.selected[0], e.selected[1] >= hi ? Infinity : e.selected[1]];
      chart.setOption({ series: [{ id: "cells", data: [[0, 0]] }] });
    });
    var tip = document.createElement("div");
    tip.className = "heatmap-tip";
    tip.hidden = true;
    el.appendChild(tip);
    var zr = chart.getZr();
    zr.on("mousemove", function (e) {
      var at = [e.offsetX, e.offsetY], cell = chart.containPixel({ gridIndex: 0 }, at) ? chart.convertFromPixel({ gridIndex: 0 }, at) : null;
      var k = cell ? cell[1] * n + cell[0] : -1;
      var v = cell && cell[0] >= 0 && cell[0] < n && cell[1] >= 0 && cell[1] < rows ? hm.values[k] : null;
      if (v == null) { tip.hidden = true; return; }
      var lines = [rowName(hm.rows[cell[1]]) + (hm.who ? " (highest: rank " + hm.who[k] + ")" : ""),
                   colName(hm.columns[cell[0]]), name + ": " + fmt(v)];
      tip.replaceChildren();
      lines.forEach(function (line, i) { if (i) { tip.appendChild(document.createElement("br")); } tip.appendChild(document.createTextNode(line)); });
      tip.hidden = false;
      var x = e.offsetX + 14, y = e.offsetY + 14;
      tip.style.left = Math.min(x, el.clientWidth - tip.offsetWidth - 4) + "px";
      tip.style.top = Math.min(y, el.clientHeight - tip.offsetHeight - 4) + "px";
    });
    zr.on("globalout", function () { tip.hidden = true; });
  }

  function memoryBands(mem, sp, metric) {
    var pins = { type: "scatter", name: "ended badly", symbol: "pin", symbolSize: 26, color: RANK0, z: 12,
                 label: { show: true, position: "right", fontSize: 10, color: RANK0, backgroundColor: "rgba(255,255,255,0.85)",
                          formatter: function (p) { return p.name; } },
                 data: metric === mem.metric ? mem.ends.map(function (e) {
                   var who = e.count > 1 ? e.count + " ranks (" + e.ranks.join(",") + (e.count > e.ranks.length ? ",…" : "") + ")" : "rank " + e.ranks[0];
                   return { step: e.step, value: [e.step, e.mib], name: who + ": " + e.label };
                 }) : [] };
    bandsChart("chart-memory", sp.memory[metric], metric + " (MiB, highest per step)", fmtMiB, pins.data.length ? [pins] : []);
    var el = document.getElementById("chart-memory");
    if (el) { el.setAttribute("data-metric", metric); }
  }

  function stepMedianChart(stats) {
    var cats = stats.map(function (s) { return "rank " + s.rank; });
    var series = [
      { type: "bar", name: "median step time", data: stats.map(function (s) {
        return { value: s.median, itemStyle: { color: s.rank === 0 ? RANK0 : "#5b8fd1" } }; }) },
      { type: "scatter", name: "95th percentile", symbol: "diamond", symbolSize: 10, color: "#333",
        data: stats.map(function (s) { return s.p95; }) }
    ];
    draw("chart-step-median", base({
      tooltip: { trigger: "axis" },
      toolbox: { show: false },
      xAxis: { type: "category", data: cats },
      yAxis: yAxis("seconds"),
      dataZoom: cats.length > 16 ? zoom(0) : [],
      series: large(series, cats.length)
    }), stats.filter(function (s) { return s.median != null; }).length);
  }

  // Who set each step's pace (report/pace.py): a bar per column of steps, in the setter's colour, as
  // high as its work beyond the median rank's (a noisy step's setter is a low bar).
  function paceStrip(p) {
    var s = p.strip, ranks = [];
    s.setter.forEach(function (r) { if (ranks.indexOf(r) < 0) { ranks.push(r); } });
    ranks.sort(function (a, b) { return a - b; });
    var label = function (i) { return s.first[i] === s.last[i] ? String(s.first[i]) : s.first[i] + "–" + s.last[i]; };
    var series = ranks.map(function (r) {
      return { type: "bar", name: "rank " + r, stack: "pace", barCategoryGap: 0, color: rankColor(r, r),
               data: s.setter.map(function (w, i) { return w === r ? s.excess_s[i] : null; }) };
    });
    draw("chart-pace", base({
      grid: { left: 72, right: 28, top: 34, bottom: 44 },
      toolbox: { show: false },
      tooltip: { trigger: "axis", formatter: function (ps) {
        var i = ps[0].dataIndex;
        return esc("step " + label(i) + ": rank " + s.setter[i] + " set the pace, " +
                   (s.excess_s[i] * 1000).toFixed(1) + " ms over the median rank's work");
      } },
      xAxis: { type: "category", data: s.first.map(function (x, i) { return label(i); }), name: "step", nameLocation: "middle", nameGap: 26 },
      yAxis: { type: "value", name: "s over median", nameLocation: "middle", nameGap: 44, splitNumber: 2 },
      series: series
    }), s.setter.length);
    var el = document.getElementById("chart-pace");
    if (el) { el.setAttribute("data-setters", s.setter.join(",")); }
  }
  // Where each named change begins, on the step-time heatmap: a marker at (first step, rank).
  function paceMarks(id, hm, marks) {
    var chart = charts[id];
    if (!chart) { return; }
    var col = function (step) {
      for (var c = 0; c < hm.columns.length; c++) { if (hm.columns[c][0] <= step && step <= hm.columns[c][1]) { return c; } }
      return step < hm.columns[0][0] ? 0 : hm.columns.length - 1;
    };
    var row = function (rank) {
      for (var r = 0; r < hm.rows.length; r++) { if (hm.rows[r][0] <= rank && rank <= hm.rows[r][1]) { return r; } }
      return -1;
    };
    var points = [];
    marks.forEach(function (m) {
      m.ranks.forEach(function (r) {
        var y = row(r);
        if (y >= 0) { points.push({ value: [col(m.first_step), y], name: m.label + " from step " + m.first_step + (m.part ? " (" + m.part + ")" : "") }); }
      });
    });
    chart.setOption({ series: [{ type: "custom", id: "cells" }, {
      type: "scatter", id: "pace-change", name: "change", symbol: "triangle", symbolRotate: -90, symbolSize: 14,
      color: "#000", z: 20, data: points,
      label: { show: true, position: "right", fontSize: 10, color: "#000", backgroundColor: "rgba(255,255,255,0.85)",
               formatter: function (q) { return q.name; } }
    }] });
    var el = document.getElementById(id);
    if (el) { el.setAttribute("data-pace-marks", String(points.length)); }
  }

  var timings = {};
  function safely(name, fn) {
    var started = Date.now();
    try { fn(); timings[name] = Date.now() - started; } catch (err) {
      var el = document.getElementById(name);
      if (el) { el.textContent = "This chart could not be drawn: " + err; }
      console.error("lorascope report: " + name + ": " + err);  // the other charts still draw
    }
  }

  // Every chart is drawn now, while the page loads, not later in timers or on scrolling: a
  // page printed, screenshotted or opened in a background tab (where timers wait) shows them all.
  var queue = [];
  var sp = data.spread;
  var bandsMode = sp && !sp.lines;
  var secs = function (v) { return v.toFixed(3) + " s"; };
  if (data.memory) {
    queue.push(["chart-memory", function () {
      if (!bandsMode) { memoryChart(data.memory); } else if (sp.memory[data.memory.metric]) { memoryBands(data.memory, sp, data.memory.metric); } else {
        document.getElementById("chart-memory").textContent = "No memory sample carries a step number: nothing to draw per step.";
      }
      memorySwitch(data.memory);
    }]);
  }
  var memHeat = sp && sp.memory[data.memory ? data.memory.metric : ""];
  if (memHeat) {
    queue.push(["chart-memory-heatmap", function () {
      heatmapChart("chart-memory-heatmap", memHeat.heatmap, data.memory.metric, fmtMiB);
    }]);
  }
  if (data.peak) { queue.push(["chart-peak", function () { peakChart(data.peak); }]); }
  if (data.collectives && data.collectives.available) {
    queue.push(["chart-collectives", function () { collectivesChart(data.collectives); }]);
    queue.push(["chart-collective-ops", function () { opTimesChart(data.op_times); }]);
  }
  if (data.kernels && data.kernels.available) { queue.push(["chart-kernels", function () { kernelChart(data.kernels); }]); }
  if (data.steps) {
    queue.push(["chart-step-time", function () {
      if (bandsMode) { if (sp.step_time) { bandsChart("chart-step-time", sp.step_time, "seconds", secs); } } else {
        perRankLines("chart-step-time", data.steps.time, "s", "seconds", secs);
      }
    }]);
    if (sp && sp.step_time) {
      queue.push(["chart-step-heatmap", function () { heatmapChart("chart-step-heatmap", sp.step_time.heatmap, "step time", secs); }]);
    }
    if (sp && sp.wait) {
      queue.push(["chart-collective-wait", function () {
        if (bandsMode) { bandsChart("chart-collective-wait", sp.wait, "seconds in collectives", secs); } else {
          perRankLines("chart-collective-wait", sp.wait.ranks, "value", "seconds in collectives", secs);
        }
      }]);
    }
    queue.push(["chart-step-median", function () { stepMedianChart(data.steps.stats); }]);
    if (data.steps.loss || (bandsMode && sp.loss)) {
      queue.push(["chart-loss", function () {
        var fmt = function (v) { return v.toFixed(4); };
        if (bandsMode && sp.loss) { bandsChart("chart-loss", sp.loss, "loss", fmt); } else { perRankLines("chart-loss", data.steps.loss, "loss", "loss", fmt); }
      }]);
    }
  }
  if (data.pace) {
    queue.push(["chart-pace", function () { paceStrip(data.pace); }]);
    if (sp && sp.step_time && sp.step_time.heatmap && data.pace.marks.length) {
      queue.push(["chart-step-heatmap", function () { paceMarks("chart-step-heatmap", sp.step_time.heatmap, data.pace.marks); }]);
    }
  }
  queue.forEach(function (job) { safely(job[0], job[1]); });
  function resizeAll() { Object.keys(charts).forEach(function (k) { charts[k].resize(); }); }
  window.addEventListener("resize", resizeAll);
  window.addEventListener("beforeprint", resizeAll);
  window.addEventListener("afterprint", resizeAll);
  window.lorascopeReport = { charts: Object.keys(charts).sort(), drawMs: timings, startedMs: startedMs,
                             doneMs: Math.round(performance.now()), options: options };
  document.body.setAttribute("data-charts-drawn", String(Object.keys(charts).length));
}());
