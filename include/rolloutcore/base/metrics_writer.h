// MetricsWriter: the Prometheus text exposition format (version 0.0.4), the one writer behind
// every /metrics page (engine, refit receiver, controller).
//
// A family is its `# HELP` and `# TYPE` lines; each sample is `name{label="value",...} number`.
// Label values and help text are escaped as the format requires: in label values `\` becomes
// `\\`, `"` becomes `\"` and a newline becomes `\n`; in help text `\` and newline are escaped.
// So an engine or model name that holds a quote or a newline cannot break the page or forge a
// sample. Metric and label names are the caller's constants and are written as given. Numbers are
// written as `std::ostream` writes them (integers exactly, doubles with 6 significant digits).
//
// Thread safety: a writer is used by one thread; build one per scrape.
#pragma once

#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace rc {

// Label pairs in the order they are written.
using MetricLabels = std::vector<std::pair<std::string, std::string>>;

enum class MetricType { kCounter, kGauge };

// `v` escaped for a label value (between the quotes).
std::string EscapeLabelValue(std::string_view v);
// `v` escaped for a # HELP line.
std::string EscapeHelpText(std::string_view v);

class MetricsWriter {
 public:
  // The # HELP and # TYPE lines of family `name`.
  MetricsWriter& Family(std::string_view name, MetricType type, std::string_view help);

  // One sample: `name{labels} value` (no braces when `labels` is empty).
  template <typename T>
    requires std::is_arithmetic_v<T>
  MetricsWriter& Sample(std::string_view name, const MetricLabels& labels, T value) {
    WriteSeries(name, labels);
    if constexpr (std::is_same_v<T, bool>) {
      out_ << (value ? 1 : 0);
    } else {
      out_ << value;
    }
    out_ << '\n';
    return *this;
  }

  // A family with its one sample.
  template <typename T>
    requires std::is_arithmetic_v<T>
  MetricsWriter& Metric(std::string_view name, MetricType type, std::string_view help, const MetricLabels& labels,
                        T value) {
    Family(name, type, help);
    return Sample(name, labels, value);
  }

  std::string Text() const { return out_.str(); }

 private:
  void WriteSeries(std::string_view name, const MetricLabels& labels);

  std::ostringstream out_;
};

// `base` followed by `extra` (for a family whose samples add one label to the page's labels).
MetricLabels WithLabel(MetricLabels base, std::string name, std::string value);

}  // namespace rc
