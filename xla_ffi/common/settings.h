// Every JAX_SMDDP_* environment setting, declared once (settings.cc; the
// test-only ones in test_settings.cc): name, kind, default, accepted range or
// choices, meaning, who reads it. One strict
// parser serves C++ and Python (jax_smddp.config reads through the bindings),
// and the docs table is generated from the same declarations
// (python -m jax_smddp.doctor --settings).
#ifndef JAX_SMDDP_COMMON_SETTINGS_H_
#define JAX_SMDDP_COMMON_SETTINGS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "xla_ffi/common/status.h"

namespace smddp {

enum class SettingKind {
  kInt,      // an integer in [min, max]
  kBytes,    // a byte count in [min, max] (an integer, optionally with K, M or G: 2^10, 2^20, 2^30)
  kSeconds,  // a positive number of seconds in [min, max]
  kChoice,   // one of `choices`
  kList,     // a comma list of `choices`
  kText,     // any text
};

struct SettingSpec {
  const char* name;
  SettingKind kind;
  const char* default_text;  // the default as the docs show it; parsed when it is a value
  double min;
  double max;
  const char* choices;  // "a|b|c" for kChoice and kList
  const char* scope;    // who reads it: "runtime", "gpu", "build", "tools", "tests"
  bool agree;           // must be equal in every process of a job
  const char* meaning;
};

// Every setting a user may set, in the docs' order (docs/settings.md).
const std::vector<SettingSpec>& AllSettings();
// The test-only settings (test_settings.cc): what tests, the mock CUDA runtime
// and the GPU test harness set, never a user; kept out of docs/settings.md and
// jax_smddp.settings(). No name is in both registries.
const std::vector<SettingSpec>& TestSettings();
// The declaration of `name` in either registry, or nullptr: every function
// below takes a test-only setting as it takes a user's.
const SettingSpec* FindSetting(const std::string& name);

// The value of `name` from the environment, checked against its declaration:
// `*text` is the value (its default text when unset, and `*set` false), or an
// error naming the setting, the value and what it accepts. `name` must be
// declared.
Status ReadSetting(const char* name, std::string* text, bool* set = nullptr);

// Parses `value` as a value of setting `name` (not from the environment):
// `*normalized` as the code compares it (trimmed; lower case for choices) and,
// for numeric kinds, `*number` (bytes with K/M/G applied); an error naming the
// setting and what it accepts otherwise.
Status ParseSetting(const std::string& name, const std::string& value, std::string* normalized,
                    double* number);

// The items of a list setting's value (trimmed, empty ones left out).
std::vector<std::string> SettingItems(const std::string& value);

// Typed reads, for code that cannot fail here: the value when the setting is
// set and valid, else its declared default (an invalid value is reported by
// CheckSettings(), which jax_smddp runs at import). The default is the
// registry's, stated once in settings.cc: these take no second one. Only for
// settings whose declared default is a value (tests/api/test_settings.py
// checks every call site); one whose default is worked out at run time
// ("cores - 1") is read with IntSettingIfSet.
int64_t IntSetting(const char* name);
double SecondsSetting(const char* name);
// The declared default of a numeric setting, whatever the environment says
// (for a value that the program, not the environment, sets: the timeout,
// which jax_smddp.set_timeout changes). Only for settings whose declared
// default is a value, as IntSetting.
double DeclaredDefault(const char* name);
// Choice and text settings: the value when set and valid; else a choice
// setting's declared default when that is one of its choices
// (JAX_SMDDP_FABRIC_WAIT: "fd"), and "" where the declared default is not a
// value ("unset", or a description: "efa if present, ...", "chosen by
// jax_smddp.tuning"), so the caller applies what "" means.
std::string TextSetting(const char* name);
// True, with `*value`, when `name` is set and valid; false (`*value` left
// alone) when the caller's run-time default applies.
bool IntSettingIfSet(const char* name, int64_t* value);

// Checks every JAX_SMDDP_* variable of the environment: the first invalid
// value is an error; names that are not declared are listed in `*unknown`
// (all of them, whatever the status).
Status CheckSettings(std::vector<std::string>* unknown);

}  // namespace smddp

#endif  // JAX_SMDDP_COMMON_SETTINGS_H_
