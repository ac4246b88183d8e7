#include "rolloutcore/base/metrics_writer.h"

namespace rc {
namespace {

std::string Escape(std::string_view v, bool quote) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '"' && quote) {
      out += "\\\"";
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

std::string EscapeLabelValue(std::string_view v) { return Escape(v, true); }
std::string EscapeHelpText(std::string_view v) { return Escape(v, false); }

MetricsWriter& MetricsWriter::Family(std::string_view name, MetricType type, std::string_view help) {
  out_ << "# HELP " << name << ' ' << EscapeHelpText(help) << "\n# TYPE " << name << ' '
       << (type == MetricType::kCounter ? "counter" : "gauge") << '\n';
  return *this;
}

void MetricsWriter::WriteSeries(std::string_view name, const MetricLabels& labels) {
  out_ << name;
  if (!labels.empty()) {
    out_ << '{';
    for (size_t i = 0; i < labels.size(); ++i) {
      if (i > 0) out_ << ',';
      out_ << labels[i].first << "=\"" << EscapeLabelValue(labels[i].second) << '"';
    }
    out_ << '}';
  }
  out_ << ' ';
}

MetricLabels WithLabel(MetricLabels base, std::string name, std::string value) {
  base.emplace_back(std::move(name), std::move(value));
  return base;
}

}  // namespace rc
