// The coordinator's dashboard: live figures, charts from GET api/v1/history, and controls.
// See sparkstep/coordinator_api/dashboard.py for the contract. Every text from the server is
// put in the page with textContent, never as HTML. The API token lives in sessionStorage only
// and is sent only on calls under api/v1/.
(function () {
  "use strict";

  var body = document.body;
  var REFRESH_MS = Number(body.dataset.refreshMs) || 1000;
  var HISTORY_MS = Number(body.dataset.historyMs) || 2000;
  var TOKEN_KEY = "sparkstep-api-token";
  var CHART_HEIGHT = 180;
  var MIN_SPAN_S = 60;
  var MARK_COLORS = { checkpoint: "#888888", rescale: "#4a78c2", restart: "#b00020" };
  var PALETTE = ["#4a78c2", "#e07b39", "#17723a", "#8a4fbf", "#b00020", "#2a9d8f", "#a05a00"];

  function byId(id) { return document.getElementById(id); }

  // -- live figures: the page's own <main id="live">, fetched again --------------------------

  var refreshes = 0;
  var failingSince = null;

  function refresh() {
    fetch(window.location.href, { cache: "no-store" })
      .then(function (response) {
        if (!response.ok) { throw new Error("HTTP " + response.status); }
        return response.text();
      })
      .then(function (text) {
        var fresh = new DOMParser().parseFromString(text, "text/html").getElementById("live");
        var current = byId("live");
        if (fresh && current) {
          current.replaceWith(document.adoptNode(fresh));
          refreshes += 1;
          body.dataset.refreshes = String(refreshes);
        }
        failingSince = null;
        byId("conn").textContent = "";
      })
      .catch(function (error) {
        if (failingSince === null) { failingSince = new Date(); }
        byId("conn").textContent =
          "coordinator not reachable since " + failingSince.toISOString() + " (" + error + ")";
      })
      .finally(function () { window.setTimeout(refresh, REFRESH_MS); });
  }

  // -- the REST API, with the token when the API wants one ------------------------------------

  function ApiError(status, detail) {
    this.status = status;
    this.detail = detail;
  }

  var afterToken = null; // a call to make again once the token is given

  function api(method, path, payload) {
    var headers = {};
    var token = window.sessionStorage.getItem(TOKEN_KEY);
    if (token) { headers.Authorization = "Bearer " + token; }
    var init = { method: method, headers: headers, cache: "no-store" };
    if (payload !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(payload);
    }
    return fetch(path, init).then(function (response) {
      return response.text().then(function (text) {
        var doc = null;
        try { doc = JSON.parse(text); } catch (ignored) { doc = null; }
        var detail = doc && typeof doc.detail === "string" ? doc.detail : text;
        if (response.status === 401) {
          var given = window.sessionStorage.getItem(TOKEN_KEY);
          if (given && given !== token) { // sent before the token was given: again with it
            return api(method, path, payload);
          }
          askToken(token ? "That token was refused; the API needs its token:" : null);
          throw new ApiError(401, detail);
        }
        if (!response.ok) { throw new ApiError(response.status, detail); }
        return doc;
      });
    });
  }

  function askToken(message) {
    var form = byId("token-form");
    if (message) { form.querySelector("label").textContent = message; }
    form.hidden = false;
  }

  byId("token-form").addEventListener("submit", function (event) {
    event.preventDefault();
    var input = byId("token");
    window.sessionStorage.setItem(TOKEN_KEY, input.value);
    input.value = "";
    byId("token-form").hidden = true;
    var again = afterToken;
    afterToken = null;
    pollHistoryNow();
    if (again) { again(); }
  });

  // -- controls ------------------------------------------------------------------------------

  var pendingConfirm = null;

  function setAnswer(kind, action, status, text) {
    var answer = byId("answer");
    answer.className = kind;
    answer.dataset.action = action;
    answer.dataset.status = String(status);
    answer.textContent = text;
  }

  function run(action, payload) {
    setAnswer("", action, "", action + ": asking the coordinator\u2026");
    api("POST", "api/v1/" + action, payload)
      .then(function (doc) {
        setAnswer("ok", action, 200, action + ": " + JSON.stringify(doc));
      })
      .catch(function (error) {
        if (error instanceof ApiError && error.status === 401) {
          afterToken = function () { run(action, payload); };
          setAnswer("error", action, 401, action + ": the API needs its token (enter it above)");
        } else if (error instanceof ApiError) {
          setAnswer("error", action, error.status,
            action + " failed (HTTP " + error.status + "): " + error.detail);
        } else {
          setAnswer("error", action, 0, action + " failed: coordinator not reachable (" + error + ")");
        }
      });
  }

  function ask(question, then) {
    byId("confirm-text").textContent = question;
    pendingConfirm = then;
    byId("confirm").hidden = false;
    byId("confirm-yes").focus();
  }

  byId("confirm-yes").addEventListener("click", function () {
    byId("confirm").hidden = true;
    var then = pendingConfirm;
    pendingConfirm = null;
    if (then) { then(); }
  });

  byId("confirm-no").addEventListener("click", function () {
    byId("confirm").hidden = true;
    pendingConfirm = null;
    setAnswer("", "", "", "cancelled");
  });

  Array.prototype.forEach.call(document.querySelectorAll("button[data-action]"), function (button) {
    button.addEventListener("click", function () {
      var action = button.dataset.action;
      var payload;
      var question = button.dataset.confirm;
      if (action === "rescale") {
        var workers = Number(byId("workers").value);
        if (!Number.isInteger(workers) || workers < 1 || workers > 1024) {
          setAnswer("error", action, 0, "rescale: enter a whole number of workers, 1 to 1024");
          return;
        }
        payload = { workers: workers };
        question = "Rescale the pipeline to " + workers + " workers? Steps pause while shards move.";
      }
      if (question) {
        ask(question, function () { run(action, payload); });
      } else {
        run(action, payload);
      }
    });
  });

  // -- charts --------------------------------------------------------------------------------

  var history = { startedAt: null, span: 3600, samples: [], events: [], last: null };
  var charts = {};
  var lagTopics = "";
  var range = [0, 1];

  function drawMarks(u) {
    var ctx = u.ctx;
    ctx.save();
    ctx.lineWidth = Math.max(1, window.devicePixelRatio || 1);
    history.events.forEach(function (event) {
      if (event.time < range[0] || event.time > range[1]) { return; }
      var x = Math.round(u.valToPos(event.time, "x", true));
      ctx.strokeStyle = MARK_COLORS[event.kind] || "#888888";
      ctx.setLineDash(event.kind === "checkpoint" ? [4, 4] : []);
      ctx.beginPath();
      ctx.moveTo(x, u.bbox.top);
      ctx.lineTo(x, u.bbox.top + u.bbox.height);
      ctx.stroke();
    });
    ctx.restore();
  }

  var compact = new Intl.NumberFormat("en", { notation: "compact", maximumFractionDigits: 1 });

  function clock(seconds) {
    return new Date(seconds * 1000).toLocaleTimeString([], {
      hour: "2-digit", minute: "2-digit", second: "2-digit", hour12: false
    });
  }

  function makeChart(name, series, points) {
    var element = byId("chart-" + name);
    if (charts[name]) { charts[name].destroy(); }
    element.textContent = "";
    var options = {
      width: Math.max(200, element.clientWidth),
      height: CHART_HEIGHT,
      scales: { x: { time: true, range: function () { return range; } } },
      axes: [
        {
          space: 90,
          values: function (u, splits) { return splits.map(clock); }
        },
        {
          size: 56,
          values: function (u, splits) {
            return splits.map(function (v) { return compact.format(v); });
          }
        }
      ],
      series: [{}].concat(series.map(function (s, i) {
        return {
          label: s,
          stroke: PALETTE[i % PALETTE.length],
          width: 1.5,
          spanGaps: false,
          points: { show: points }
        };
      })),
      hooks: { draw: [drawMarks] }
    };
    var data = [[]].concat(series.map(function () { return []; }));
    charts[name] = new window.uPlot(options, data, element);
    return charts[name];
  }

  function column(field) {
    return history.samples.map(function (s) { return s[field]; });
  }

  function countPoints(values) {
    return values.filter(function (v) { return v !== null && v !== undefined; }).length;
  }

  function show(name, data, counted) {
    charts[name].setData(data, true);
    byId("chart-" + name).dataset.points = String(countPoints(counted));
  }

  function draw() {
    var samples = history.samples;
    var times = samples.map(function (s) { return s.time; });
    var all = times.concat(history.events.map(function (e) { return e.time; }));
    if (all.length) {
      var last = Math.max.apply(null, all);
      var first = Math.min.apply(null, all);
      range = [Math.min(first, last - MIN_SPAN_S), last];
    }
    var inputRate = column("input_rate");
    show("rates", [times, inputRate, column("output_rate")], inputRate);
    var p50 = column("latency_p50_ms");
    show("latency", [times, p50, column("latency_max_ms")], p50);
    var topics = [];
    samples.forEach(function (s) {
      Object.keys(s.lag).forEach(function (t) { if (topics.indexOf(t) < 0) { topics.push(t); } });
    });
    topics.sort();
    if (topics.join("\n") !== lagTopics) {
      lagTopics = topics.join("\n");
      makeChart("lag", topics, false);
    }
    var lag = topics.map(function (t) {
      return samples.map(function (s) { return t in s.lag ? s.lag[t] : null; });
    });
    var anyLag = samples.map(function (s) { return Object.keys(s.lag).length ? 1 : null; });
    show("lag", [times].concat(lag), anyLag);
    var checkpoints = history.events.filter(function (e) {
      return e.kind === "checkpoint" && e.duration_ms !== null;
    });
    var durations = checkpoints.map(function (e) { return e.duration_ms; });
    show("checkpoints", [checkpoints.map(function (e) { return e.time; }), durations], durations);
  }

  function receive(doc) {
    if (doc.started_at !== history.startedAt) { // another coordinator: start again
      history = { startedAt: doc.started_at, span: doc.span_s, samples: [], events: [], last: null };
    }
    history.samples = history.samples.concat(doc.samples);
    history.events = history.events.concat(doc.events);
    var times = doc.samples.concat(doc.events).map(function (x) { return x.time; });
    if (times.length) {
      history.last = Math.max(history.last === null ? -Infinity : history.last,
        Math.max.apply(null, times));
    }
    if (history.last !== null) {
      var oldest = history.last - history.span;
      history.samples = history.samples.filter(function (s) { return s.time >= oldest; });
      history.events = history.events.filter(function (e) { return e.time >= oldest; });
    }
    draw();
  }

  var historyTimer = null;

  function pollHistory() {
    historyTimer = null;
    var path = "api/v1/history";
    if (history.last !== null) { path += "?since=" + encodeURIComponent(String(history.last)); }
    api("GET", path)
      .then(function (doc) {
        receive(doc);
        byId("history-note").textContent = "";
      })
      .catch(function (error) {
        byId("history-note").textContent = error instanceof ApiError && error.status === 401
          ? "(the charts need the API token: enter it above)"
          : "(history not available: " + (error instanceof ApiError
            ? "HTTP " + error.status + " " + error.detail : error) + ")";
      })
      .finally(function () {
        if (historyTimer === null) { historyTimer = window.setTimeout(pollHistory, HISTORY_MS); }
      });
  }

  function pollHistoryNow() {
    if (historyTimer !== null) {
      window.clearTimeout(historyTimer);
      historyTimer = null;
      pollHistory();
    }
  }

  function resize() {
    Object.keys(charts).forEach(function (name) {
      var element = byId("chart-" + name);
      charts[name].setSize({ width: Math.max(200, element.clientWidth), height: CHART_HEIGHT });
    });
  }

  if (window.uPlot) {
    makeChart("rates", ["input records/s", "output records/s"], false);
    makeChart("latency", ["p50 ms", "max ms"], true); // steps can be sparse: show each
    makeChart("lag", [], false);
    makeChart("checkpoints", ["duration ms"], true);
    window.addEventListener("resize", resize);
    pollHistory();
  } else {
    byId("history-note").textContent = "(the chart library did not load)";
  }
  window.setTimeout(refresh, REFRESH_MS);
})();
