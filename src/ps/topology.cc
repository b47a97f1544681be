// The router, cost model and host executor declared in include/hps/topology.h.
#include "hps/topology.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <queue>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "hps/config.h"
#include "ps/route_checks.h"

namespace hps {

const char* RouteKindName(RouteKind k) {
  switch (k) {
    case RouteKind::kNone: return "none";
    case RouteKind::kDirect: return "direct";
    case RouteKind::kHost: return "host";
    case RouteKind::kRelay: return "relay";
  }
  return "?";
}

namespace {

bool IsEndpoint(DeviceKind k) { return k == DeviceKind::kGpu || k == DeviceKind::kHost; }

std::string Fmt(double v, int prec) {
  std::ostringstream s;
  s.setf(std::ios::fixed);
  s.precision(prec);
  s << v;
  return s.str();
}

// Adjacency and the link of each device pair, built once per call.
struct Graph {
  const Topology& t;
  std::vector<std::vector<std::pair<int32_t, int32_t>>> adj;  // device -> (neighbour, link)
  std::map<std::pair<int32_t, int32_t>, int32_t> link_of;

  explicit Graph(const Topology& topo) : t(topo), adj(topo.devices.size()) {
    for (int32_t i = 0; i < static_cast<int32_t>(t.links.size()); ++i) {
      const TopoLink& l = t.links[i];
      adj[l.a].push_back({l.b, i});
      adj[l.b].push_back({l.a, i});
      link_of[{std::min(l.a, l.b), std::max(l.a, l.b)}] = i;
    }
  }

  int32_t Link(int32_t a, int32_t b) const {
    auto it = link_of.find({std::min(a, b), std::max(a, b)});
    return it == link_of.end() ? -1 : it->second;
  }

  // Shortest path from src to dst (devices) whose inner devices are switches
  // only (need_cpu false: a direct path, NVLink or NVSwitch or PCIe P2P under
  // one switch) or non-endpoints through at least one CPU (need_cpu true: the
  // host path). Weight of a hop: its latency plus the time of 1 MB over it, so
  // a faster link wins over a slower one with equal hops. Empty if none.
  std::vector<int32_t> Path(int32_t src, int32_t dst, bool need_cpu) const {
    const size_t n = t.devices.size();
    // state = device * 2 + (passed a CPU)
    std::vector<double> dist(2 * n, std::numeric_limits<double>::infinity());
    std::vector<int32_t> prev(2 * n, -1);
    using Item = std::pair<double, int32_t>;
    std::priority_queue<Item, std::vector<Item>, std::greater<>> q;
    dist[2 * src] = 0;
    q.push({0, 2 * src});
    while (!q.empty()) {
      auto [d, s] = q.top();
      q.pop();
      if (d > dist[s]) continue;
      const int32_t v = s / 2;
      if (v != src && v == dst) continue;
      for (auto [w, li] : adj[v]) {
        const DeviceKind k = t.devices[w].kind;
        if (w != dst) {
          if (IsEndpoint(k)) continue;
          if (!need_cpu && k != DeviceKind::kSwitch) continue;
        }
        const int32_t cpu = (s & 1) | (k == DeviceKind::kCpu ? 1 : 0);
        const int32_t ns = 2 * w + cpu;
        const double nd = d + t.links[li].latency_us + 1e3 / t.links[li].gbps;
        if (nd < dist[ns]) {
          dist[ns] = nd;
          prev[ns] = s;
          q.push({nd, ns});
        }
      }
    }
    const int32_t end = 2 * dst + (need_cpu ? 1 : 0);
    if (std::isinf(dist[end])) return {};
    std::vector<int32_t> path;
    for (int32_t s = end; s != -1; s = prev[s]) path.push_back(s / 2);
    std::reverse(path.begin(), path.end());
    return path;
  }

  double Bottleneck(const std::vector<int32_t>& p) const {
    double bw = std::numeric_limits<double>::infinity();
    for (size_t i = 1; i < p.size(); ++i) bw = std::min(bw, t.links[Link(p[i - 1], p[i])].gbps);
    return bw;
  }
  double Latency(const std::vector<int32_t>& p) const {
    double us = 0;
    for (size_t i = 1; i < p.size(); ++i) us += t.links[Link(p[i - 1], p[i])].latency_us;
    return us;
  }
  // Seconds to move b bytes over p alone (streamed: the slowest hop bounds it).
  double Alone(const std::vector<int32_t>& p, uint64_t b) const {
    return static_cast<double>(b) / (Bottleneck(p) * 1e9) + Latency(p) * 1e-6;
  }
  std::string Describe(const std::vector<int32_t>& p) const {
    std::string s;
    for (size_t i = 1; i < p.size(); ++i) {
      const TopoLink& l = t.links[Link(p[i - 1], p[i])];
      if (!s.empty()) s += ", ";
      s += t.devices[p[i - 1]].name + "-" + t.devices[p[i]].name + " " + l.kind + " " + Fmt(l.gbps, 0) + " GB/s";
    }
    return s;
  }
};

// The two legs of a route: phase 1 and (a relay's) phase 2.
void Legs(const Route& r, std::vector<int32_t>* first, std::vector<int32_t>* second, const Topology& t) {
  first->clear();
  second->clear();
  if (r.kind != RouteKind::kRelay) {
    *first = r.path;
    return;
  }
  const std::vector<int32_t> ep = t.Endpoints();
  const int32_t mid = ep[r.via];
  auto at = std::find(r.path.begin(), r.path.end(), mid);
  first->assign(r.path.begin(), at + 1);
  second->assign(at, r.path.end());
}

struct Evaluation {
  ScheduleCost cost;
  double spread = 0;  // sum over phases and link directions of (seconds busy)^2
};

Evaluation Evaluate(const Graph& g, const std::vector<uint64_t>& bytes, const std::vector<Route>& routes) {
  const Topology& t = g.t;
  const size_t nl = t.links.size();
  const size_t e = static_cast<size_t>(std::sqrt(static_cast<double>(bytes.size())) + 0.5);
  std::vector<double> load[2] = {std::vector<double>(2 * nl, 0), std::vector<double>(2 * nl, 0)};
  double lat[2] = {0, 0};
  Evaluation ev;
  ScheduleCost& c = ev.cost;
  c.route_count.assign(4, 0);
  std::vector<int32_t> legs[2];
  for (size_t i = 0; i < routes.size(); ++i) {
    const Route& r = routes[i];
    c.route_count[static_cast<size_t>(r.kind)]++;
    const uint64_t b = bytes[static_cast<size_t>(r.src) * e + static_cast<size_t>(r.dst)];
    if (r.kind == RouteKind::kNone || b == 0) continue;
    if (r.kind == RouteKind::kRelay) c.relayed_bytes += b;
    Legs(r, &legs[0], &legs[1], t);
    for (int ph = 0; ph < 2; ++ph) {
      const auto& p = legs[ph];
      if (p.size() < 2) continue;
      for (size_t h = 1; h < p.size(); ++h) {
        const int32_t li = g.Link(p[h - 1], p[h]);
        const size_t dir = (t.links[li].a == p[h - 1]) ? 0 : 1;
        load[ph][2 * li + dir] += static_cast<double>(b);
        ++c.hops;
      }
      lat[ph] = std::max(lat[ph], g.Latency(p) * 1e-6);
    }
  }
  c.link_bytes.assign(2 * nl, 0);
  c.phase_seconds.assign(2, 0);
  for (int ph = 0; ph < 2; ++ph) {
    double worst = 0;
    for (size_t l = 0; l < 2 * nl; ++l) {
      const double s = load[ph][l] / (t.links[l / 2].gbps * 1e9);
      worst = std::max(worst, s);
      ev.spread += s * s;
      c.link_bytes[l] += load[ph][l];
    }
    c.phase_seconds[ph] = worst > 0 ? worst + lat[ph] : 0;
    c.seconds += c.phase_seconds[ph];
  }
  return ev;
}

bool Better(const Evaluation& a, const Evaluation& b) {
  const double eps = 1e-12 * std::max(1.0, b.cost.seconds);
  if (a.cost.seconds < b.cost.seconds - eps) return true;
  if (a.cost.seconds > b.cost.seconds + eps) return false;
  return a.spread < b.spread * (1 - 1e-9);
}

size_t CheckMatrix(const Topology& t, const std::vector<uint64_t>& bytes) {
  const size_t e = t.Endpoints().size();
  if (e < 1) throw std::invalid_argument("topology: no endpoints (GPUs or host partitions) to route between");
  if (bytes.size() != e * e)
    throw std::invalid_argument("topology: the transfer matrix has " + std::to_string(bytes.size()) +
                                " entries, expected " + std::to_string(e) + " x " + std::to_string(e) +
                                " (one per endpoint pair)");
  return e;
}

}  // namespace

void Topology::Validate() const {
  std::map<std::string, size_t> seen;
  for (size_t i = 0; i < devices.size(); ++i) {
    const auto& d = devices[i];
    if (d.name.empty()) throw std::invalid_argument("topology: device " + std::to_string(i) + " has no name");
    if (!seen.emplace(d.name, i).second)
      throw std::invalid_argument("topology: device " + std::to_string(i) + " repeats the name '" + d.name + "'");
  }
  std::map<std::pair<int32_t, int32_t>, size_t> pairs;
  const auto n = static_cast<int32_t>(devices.size());
  for (size_t i = 0; i < links.size(); ++i) {
    const auto& l = links[i];
    const std::string where = "topology: link " + std::to_string(i);
    if (l.a < 0 || l.a >= n || l.b < 0 || l.b >= n)
      throw std::invalid_argument(where + " joins device " + std::to_string(l.a) + " and " + std::to_string(l.b) +
                                  ", but there are " + std::to_string(n) + " devices");
    if (l.a == l.b) throw std::invalid_argument(where + " joins " + devices[l.a].name + " to itself");
    if (!(l.gbps > 0) || !std::isfinite(l.gbps))
      throw std::invalid_argument(where + " (" + devices[l.a].name + "-" + devices[l.b].name +
                                  "): bandwidth must be > 0 GB/s, got " + std::to_string(l.gbps));
    if (!(l.latency_us >= 0) || !std::isfinite(l.latency_us))
      throw std::invalid_argument(where + " (" + devices[l.a].name + "-" + devices[l.b].name +
                                  "): latency must be >= 0 us, got " + std::to_string(l.latency_us));
    auto key = std::make_pair(std::min(l.a, l.b), std::max(l.a, l.b));
    auto [it, fresh] = pairs.emplace(key, i);
    if (!fresh)
      throw std::invalid_argument(where + " repeats link " + std::to_string(it->second) + " between " +
                                  devices[l.a].name + " and " + devices[l.b].name +
                                  " (give one link with the bridges' total bandwidth)");
  }
}

std::vector<int32_t> Topology::Endpoints() const {
  std::vector<int32_t> out;
  for (size_t i = 0; i < devices.size(); ++i)
    if (IsEndpoint(devices[i].kind)) out.push_back(static_cast<int32_t>(i));
  return out;
}

ScheduleCost CostOf(const Topology& t, const std::vector<uint64_t>& bytes, const std::vector<Route>& routes) {
  t.Validate();
  const size_t e = CheckMatrix(t, bytes);
  if (routes.size() != e * e)
    throw std::invalid_argument("topology: " + std::to_string(routes.size()) + " routes for " + std::to_string(e) +
                                " x " + std::to_string(e) + " endpoint pairs");
  Graph g(t);
  // Evaluate walks each path's links and splits a relay's at its middleman:
  // a route from elsewhere must be one it can walk.
  const std::vector<int32_t> ep = t.Endpoints();
  for (size_t i = 0; i < e * e; ++i) {
    const Route& r = routes[i];
    const std::string where = "topology: route " + std::to_string(i);
    if (r.src != static_cast<int32_t>(i / e) || r.dst != static_cast<int32_t>(i % e))
      throw std::invalid_argument(where + " is for (" + std::to_string(r.src) + ", " + std::to_string(r.dst) +
                                  "), expected (" + std::to_string(i / e) + ", " + std::to_string(i % e) + ")");
    if (r.kind == RouteKind::kNone || bytes[i] == 0) continue;
    if (r.kind != RouteKind::kDirect && r.kind != RouteKind::kHost && r.kind != RouteKind::kRelay)
      throw std::invalid_argument(where + " has kind " + std::to_string(static_cast<int32_t>(r.kind)));
    if (r.path.size() < 2 || r.path.front() != ep[i / e] || r.path.back() != ep[i % e])
      throw std::invalid_argument(where + "'s path does not run from " + t.devices[ep[i / e]].name + " to " +
                                  t.devices[ep[i % e]].name);
    for (size_t h = 1; h < r.path.size(); ++h) {
      const int32_t a = r.path[h - 1], b = r.path[h];
      if (a < 0 || b < 0 || static_cast<size_t>(std::max(a, b)) >= t.devices.size() || g.Link(a, b) < 0)
        throw std::invalid_argument(where + "'s path steps from device " + std::to_string(a) + " to " +
                                    std::to_string(b) + ", which no link joins");
    }
    if (r.kind == RouteKind::kRelay &&
        (r.via < 0 || static_cast<size_t>(r.via) >= e ||
         std::find(r.path.begin(), r.path.end(), ep[static_cast<size_t>(r.via)]) == r.path.end()))
      throw std::invalid_argument(where + " relays via endpoint " + std::to_string(r.via) +
                                  ", which its path does not pass");
  }
  return Evaluate(g, bytes, routes).cost;
}

RoutePlan PlanRoutes(const Topology& t, const std::vector<uint64_t>& bytes, Schedule schedule) {
  t.Validate();
  const size_t e = CheckMatrix(t, bytes);
  const std::vector<int32_t> ep = t.Endpoints();
  Graph g(t);
  // Every endpoint pair's direct and host paths, once.
  std::vector<std::vector<int32_t>> direct(e * e), host(e * e);
  for (size_t s = 0; s < e; ++s)
    for (size_t d = 0; d < e; ++d)
      if (s != d) {
        direct[s * e + d] = g.Path(ep[s], ep[d], false);
        host[s * e + d] = g.Path(ep[s], ep[d], true);
      }

  // The candidates of each pair, cheapest alone first.
  struct Candidate {
    Route route;
    double alone = 0;
  };
  std::vector<std::vector<Candidate>> cands(e * e);
  RoutePlan plan;
  plan.routes.resize(e * e);
  for (size_t s = 0; s < e; ++s) {
    for (size_t d = 0; d < e; ++d) {
      Route& r = plan.routes[s * e + d];
      r.src = static_cast<int32_t>(s);
      r.dst = static_cast<int32_t>(d);
      const uint64_t b = bytes[s * e + d];
      if (s == d || b == 0) continue;
      auto& cs = cands[s * e + d];
      const auto& dp = direct[s * e + d];
      const auto& hp = host[s * e + d];
      if (!dp.empty() && schedule != Schedule::kHost) cs.push_back({{r.src, r.dst, RouteKind::kDirect, -1, dp, ""}, g.Alone(dp, b)});
      // The direct schedule is a fixed baseline: the host path only where there is no link.
      if (!hp.empty() && (schedule != Schedule::kDirect || dp.empty()))
        cs.push_back({{r.src, r.dst, RouteKind::kHost, -1, hp, ""}, g.Alone(hp, b)});
      if (schedule == Schedule::kRelay) {
        for (size_t m = 0; m < e; ++m) {
          if (m == s || m == d) continue;
          const auto& a = direct[s * e + m];
          const auto& c = direct[m * e + d];
          if (a.empty() || c.empty()) continue;
          std::vector<int32_t> p = a;
          p.insert(p.end(), c.begin() + 1, c.end());
          cs.push_back({{r.src, r.dst, RouteKind::kRelay, static_cast<int32_t>(m), p, ""}, g.Alone(a, b) + g.Alone(c, b)});
        }
      }
      if (cs.empty())
        throw std::invalid_argument("topology: no route from " + t.devices[ep[s]].name + " to " +
                                    t.devices[ep[d]].name + (schedule == Schedule::kHost
                                                                 ? " through a CPU"
                                                                 : " (no direct link, host path or middleman)"));
      std::stable_sort(cs.begin(), cs.end(), [](const Candidate& x, const Candidate& y) { return x.alone < y.alone; });
      r = cs.front().route;
    }
  }

  // Moves a pair to another candidate while that lowers the schedule's time.
  // A single move rarely shortens the slowest link, and the first relay opens
  // a second phase, so the search runs from two starts: every pair on its
  // cheapest route alone, and every pair that can relay on its cheapest relay;
  // the better result wins (the first on a tie).
  auto improve = [&](std::vector<Route>& routes) {
    Evaluation best = Evaluate(g, bytes, routes);
    constexpr int kMaxRounds = 16;
    for (int round = 0; round < kMaxRounds; ++round) {
      bool changed = false;
      for (size_t i = 0; i < e * e; ++i) {
        if (cands[i].size() < 2) continue;
        const Route kept = routes[i];
        size_t pick = cands[i].size();
        for (size_t c = 0; c < cands[i].size(); ++c) {
          const Route& alt = cands[i][c].route;
          if (alt.kind == kept.kind && alt.via == kept.via) continue;
          routes[i] = alt;
          Evaluation ev = Evaluate(g, bytes, routes);
          if (Better(ev, best)) {
            best = std::move(ev);
            pick = c;
          }
          routes[i] = kept;
        }
        if (pick < cands[i].size()) {
          routes[i] = cands[i][pick].route;
          changed = true;
        }
      }
      if (!changed) break;
    }
    return best;
  };
  Evaluation best = improve(plan.routes);
  if (schedule == Schedule::kRelay) {
    std::vector<Route> relayed = plan.routes;
    bool any = false;
    for (size_t i = 0; i < e * e; ++i)
      for (const auto& c : cands[i])
        if (c.route.kind == RouteKind::kRelay) {
          relayed[i] = c.route;  // cands are sorted: the cheapest relay alone
          any = true;
          break;
        }
    if (any) {
      Evaluation other = improve(relayed);
      if (Better(other, best)) {
        best = std::move(other);
        plan.routes = std::move(relayed);
      }
    }
  }

  // Reasons: the route's time alone, the alternatives', and whether the
  // all-to-all's contention moved it off its cheapest-alone route.
  for (size_t i = 0; i < e * e; ++i) {
    if (cands[i].empty()) continue;
    Route& r = plan.routes[i];
    const uint64_t b = bytes[i];
    std::string why;
    if (r.kind == RouteKind::kRelay) {
      why = "relay via " + t.devices[ep[r.via]].name + " (" + g.Describe(r.path) + ")";
    } else {
      why = std::string(RouteKindName(r.kind)) + " (" + g.Describe(r.path) + ")";
    }
    double mine = 0;
    for (const auto& c : cands[i])
      if (c.route.kind == r.kind && c.route.via == r.via) mine = c.alone;
    why += ": " + Fmt(mine * 1e3, 3) + " ms alone for " + std::to_string(b) + " B";
    if (direct[i].empty()) why += "; no direct link";
    const Candidate* best_host = nullptr;
    const Candidate* best_direct = nullptr;
    for (const auto& c : cands[i]) {
      if (c.route.kind == RouteKind::kHost && !best_host) best_host = &c;
      if (c.route.kind == RouteKind::kDirect && !best_direct) best_direct = &c;
    }
    if (best_host && r.kind != RouteKind::kHost) why += "; host path " + Fmt(best_host->alone * 1e3, 3) + " ms";
    if (best_direct && r.kind != RouteKind::kDirect) why += "; direct " + Fmt(best_direct->alone * 1e3, 3) + " ms";
    const Route& first = cands[i].front().route;
    if (first.kind != r.kind || first.via != r.via) {
      why += "; cheapest alone is " + std::string(RouteKindName(first.kind)) +
             (first.kind == RouteKind::kRelay ? " via " + t.devices[ep[first.via]].name : "") +
             ", moved off it by the all-to-all's load on shared links";
    }
    r.reason = why;
  }
  plan.cost = best.cost;
  return plan;
}

RoutePlan FixedRoutes(const Topology& t, const std::vector<uint64_t>& bytes, const std::vector<int32_t>& via) {
  t.Validate();
  const size_t e = CheckMatrix(t, bytes);
  if (via.size() != e * e)
    throw std::invalid_argument("topology: " + std::to_string(via.size()) + " middlemen for " + std::to_string(e) +
                                " x " + std::to_string(e) + " endpoint pairs");
  const std::vector<int32_t> ep = t.Endpoints();
  Graph g(t);
  RoutePlan plan;
  plan.routes.resize(e * e);
  for (size_t s = 0; s < e; ++s) {
    for (size_t d = 0; d < e; ++d) {
      Route& r = plan.routes[s * e + d];
      r.src = static_cast<int32_t>(s);
      r.dst = static_cast<int32_t>(d);
      if (s == d || bytes[s * e + d] == 0) continue;
      const std::string pair = t.devices[ep[s]].name + " -> " + t.devices[ep[d]].name;
      const int32_t m = via[s * e + d];
      if (m >= 0) {
        if (static_cast<size_t>(m) >= e || static_cast<size_t>(m) == s || static_cast<size_t>(m) == d)
          throw std::invalid_argument("topology: " + pair + " relays via endpoint " + std::to_string(m) +
                                      ", which is not a third endpoint of " + std::to_string(e));
        const auto a = g.Path(ep[s], ep[m], false), c = g.Path(ep[m], ep[d], false);
        if (a.empty() || c.empty())
          throw std::invalid_argument("topology: " + pair + " relays via " + t.devices[ep[m]].name +
                                      ", which has no direct path to " +
                                      (a.empty() ? t.devices[ep[s]].name : t.devices[ep[d]].name));
        r.kind = RouteKind::kRelay;
        r.via = m;
        r.path = a;
        r.path.insert(r.path.end(), c.begin() + 1, c.end());
        r.reason = "fixed: relay via " + t.devices[ep[m]].name;
        continue;
      }
      r.path = g.Path(ep[s], ep[d], false);
      r.kind = RouteKind::kDirect;
      if (r.path.empty()) {
        r.path = g.Path(ep[s], ep[d], true);
        r.kind = RouteKind::kHost;
      }
      if (r.path.empty()) throw std::invalid_argument("topology: no route for " + pair);
      r.reason = std::string("fixed: ") + RouteKindName(r.kind);
    }
  }
  plan.cost = Evaluate(g, bytes, plan.routes).cost;
  return plan;
}

namespace detail {

void CheckRoutes(const char* executor, const RoutePlan& plan, const std::vector<uint64_t>& bytes, size_t e) {
  uint64_t total = 0;
  for (size_t i = 0; i < e * e; ++i) {
    if (bytes[i] > std::numeric_limits<uint64_t>::max() - total)
      throw std::invalid_argument(std::string(executor) + ": the transfer matrix's bytes overflow 64 bits at pair (" +
                                  std::to_string(i / e) + ", " + std::to_string(i % e) + ")");
    total += bytes[i];
  }
  for (size_t i = 0; i < e * e; ++i) {
    const Route& r = plan.routes[i];
    if (r.src != static_cast<int32_t>(i / e) || r.dst != static_cast<int32_t>(i % e))
      throw std::invalid_argument(std::string(executor) + ": route " + std::to_string(i) + " is for (" +
                                  std::to_string(r.src) + ", " + std::to_string(r.dst) + "), expected (" +
                                  std::to_string(i / e) + ", " + std::to_string(i % e) + ")");
    if (bytes[i] == 0 || i / e == i % e) continue;
    if (r.kind == RouteKind::kNone)
      throw std::invalid_argument(std::string(executor) + ": pair (" + std::to_string(i / e) + ", " +
                                  std::to_string(i % e) + ") has " + std::to_string(bytes[i]) + " bytes but no route");
    if (r.kind == RouteKind::kRelay && (r.via < 0 || static_cast<size_t>(r.via) >= e))
      throw std::invalid_argument(std::string(executor) + ": route " + std::to_string(i) + " relays via endpoint " +
                                  std::to_string(r.via) + " of " + std::to_string(e));
  }
}

}  // namespace detail

ExecStats ExecuteOnHost(const RoutePlan& plan, const std::vector<uint64_t>& bytes,
                        const std::vector<const uint8_t*>& send, const std::vector<uint8_t*>& recv) {
  const size_t e = send.size();
  if (recv.size() != e || bytes.size() != e * e || plan.routes.size() != e * e)
    throw std::invalid_argument("host executor: " + std::to_string(send.size()) + " send and " +
                                std::to_string(recv.size()) + " receive buffers, " + std::to_string(bytes.size()) +
                                " matrix entries and " + std::to_string(plan.routes.size()) +
                                " routes do not describe one E x E exchange");
  detail::CheckRoutes("host executor", plan, bytes, e);
  // Segment offsets: send[s] by destination, recv[d] by source.
  std::vector<uint64_t> send_off(e * e, 0), recv_off(e * e, 0);
  for (size_t s = 0; s < e; ++s)
    for (size_t d = 1; d < e; ++d) send_off[s * e + d] = send_off[s * e + d - 1] + bytes[s * e + d - 1];
  for (size_t d = 0; d < e; ++d)
    for (size_t s = 1; s < e; ++s) recv_off[(s)*e + d] = recv_off[(s - 1) * e + d] + bytes[(s - 1) * e + d];
  // Staging: one buffer per relaying middleman, one per host route's first
  // hop (keyed by that device's index, negated minus one to keep the two
  // apart), laid out in pair order.
  std::map<int64_t, uint64_t> need;
  std::vector<int64_t> stage_key(e * e, 0);
  std::vector<uint64_t> stage_off(e * e, 0);
  for (size_t i = 0; i < e * e; ++i) {
    const Route& r = plan.routes[i];
    if (bytes[i] == 0 || i / e == i % e) continue;
    if (r.kind == RouteKind::kRelay) {
      stage_key[i] = r.via;
    } else if (r.kind == RouteKind::kHost) {
      stage_key[i] = -1 - (r.path.size() > 2 ? r.path[1] : 0);
    } else {
      continue;
    }
    stage_off[i] = need[stage_key[i]];
    need[stage_key[i]] += bytes[i];
  }
  std::map<int64_t, std::vector<uint8_t>> stage;
  for (auto& [k, n] : need) stage[k].resize(n);

  ExecStats st;
  st.phase_seconds.assign(2, 0);
  using Clock = std::chrono::steady_clock;
  for (int ph = 0; ph < 2; ++ph) {
    const auto t0 = Clock::now();
    for (size_t i = 0; i < e * e; ++i) {
      const size_t s = i / e, d = i % e;
      const uint64_t b = bytes[i];
      if (b == 0) continue;
      const uint8_t* from = send[s] + send_off[i];
      uint8_t* to = recv[d] + recv_off[s * e + d];
      const RouteKind k = s == d ? RouteKind::kDirect : plan.routes[i].kind;
      if (k == RouteKind::kDirect) {
        if (ph == 0) {
          std::memcpy(to, from, b);
          st.bytes_copied += b;
        }
        continue;
      }
      uint8_t* buf = stage[stage_key[i]].data() + stage_off[i];
      if (ph == 0) {
        std::memcpy(buf, from, b);
      } else {
        std::memcpy(to, buf, b);
        st.staged_bytes += b;
      }
      st.bytes_copied += b;
    }
    st.phase_seconds[ph] = std::chrono::duration<double>(Clock::now() - t0).count();
    st.seconds += st.phase_seconds[ph];
  }
  return st;
}

ExecStats ExecuteOnCuda(const RoutePlan& plan, const std::vector<uint64_t>& bytes,
                        const std::vector<int32_t>& gpu_ids, const std::vector<const uint8_t*>& send,
                        const std::vector<uint8_t*>& recv) {
  CudaExchangeBuffers kept;
  return ExecuteOnCuda(plan, bytes, gpu_ids, send, recv, kept);
}

#if !HPS_HAVE_CUDA
struct CudaExchangeBuffers::State {};
CudaExchangeBuffers::CudaExchangeBuffers() : state_(std::make_unique<State>()) {}
CudaExchangeBuffers::~CudaExchangeBuffers() = default;

ExecStats ExecuteOnCuda(const RoutePlan& plan, const std::vector<uint64_t>& bytes, const std::vector<int32_t>&,
                        const std::vector<const uint8_t*>& send, const std::vector<uint8_t*>&, CudaExchangeBuffers&) {
  // A bad plan is named as the CUDA build names it, whatever the build.
  const size_t e = send.size();
  if (bytes.size() == e * e && plan.routes.size() == e * e) detail::CheckRoutes("CUDA executor", plan, bytes, e);
  throw std::runtime_error("CUDA executor: this build of hps has no CUDA support "
                           "(configure with HPS_CUDA=ON and nvcc on the PATH)");
}
ExecStats ExecuteOnCudaFromHost(const RoutePlan& plan, const std::vector<uint64_t>& bytes,
                                const std::vector<int32_t>& gpu_ids, const std::vector<const uint8_t*>& send,
                                const std::vector<uint8_t*>& recv) {
  return ExecuteOnCuda(plan, bytes, gpu_ids, send, recv);  // (throws: no CUDA)
}
bool CudaExecutorAvailable() { return false; }
#endif

}  // namespace hps
