//! One breaker per dependency, and per endpoint where their failures differ.
//!
//! A single breaker shared by every dependency would let a sick
//! recommendations service cut a caller off from a healthy payments service.
//! The registry makes each dependency's breaker on first use, from the default
//! configuration or that dependency's override, so scoping breakers right is
//! the easy path.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use keel_core::Name;
use parking_lot::RwLock;
use serde::{Deserialize, Serialize};

use super::{BreakerMetrics, CircuitBreaker, CircuitBreakerConfig};
use crate::ConfigError;

/// A registry's configuration: the defaults, and whole configurations for the
/// dependencies that differ.
///
/// An override is keyed by dependency (`"payments"`), or by dependency and
/// endpoint (`"payments/refunds"`); an endpoint without its own override uses
/// its dependency's. Fields an override leaves out take the built-in
/// defaults, not the registry's `defaults`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BreakerRegistryConfig {
    /// The configuration of every dependency without an override.
    pub defaults: CircuitBreakerConfig,
    /// Overrides, by `"dependency"` or `"dependency/endpoint"`.
    pub dependencies: BTreeMap<String, CircuitBreakerConfig>,
}

impl BreakerRegistryConfig {
    /// Validates every configuration and builds the registry.
    pub fn build(self) -> Result<BreakerRegistry, ConfigError> {
        self.defaults.validate()?;
        for (key, config) in &self.dependencies {
            config.validate().map_err(|err| {
                ConfigError::new(
                    err.field,
                    format!("{} (in the override for `{key}`)", err.reason),
                )
            })?;
        }
        Ok(BreakerRegistry {
            inner: Arc::new(Registry {
                defaults: self.defaults,
                overrides: self.dependencies.into_iter().collect(),
                breakers: RwLock::default(),
            }),
        })
    }
}

/// Circuit breakers by dependency (and endpoint), made on first use. Clones
/// share the same breakers.
///
/// Look a breaker up once and keep the handle where calls are hot: a lookup
/// takes a read lock.
#[derive(Debug, Clone)]
pub struct BreakerRegistry {
    inner: Arc<Registry>,
}

#[derive(Debug)]
struct Registry {
    defaults: CircuitBreakerConfig,
    overrides: HashMap<String, CircuitBreakerConfig>,
    breakers: RwLock<HashMap<Name, Dependency>>,
}

#[derive(Debug, Default)]
struct Dependency {
    breaker: Option<CircuitBreaker>,
    endpoints: HashMap<Name, CircuitBreaker>,
}

/// One breaker's state in a [`BreakerRegistry::snapshot`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BreakerSnapshot {
    /// The dependency.
    pub dependency: String,
    /// The endpoint, for an endpoint's breaker.
    pub endpoint: Option<String>,
    /// The breaker's state and rates.
    pub metrics: BreakerMetrics,
}

impl BreakerRegistry {
    /// A registry making every breaker from `defaults`.
    pub fn new(defaults: CircuitBreakerConfig) -> Result<Self, ConfigError> {
        BreakerRegistryConfig {
            defaults,
            dependencies: BTreeMap::new(),
        }
        .build()
    }

    /// A registry from defaults and per-dependency overrides.
    pub fn with_overrides(
        defaults: CircuitBreakerConfig,
        overrides: impl IntoIterator<Item = (String, CircuitBreakerConfig)>,
    ) -> Result<Self, ConfigError> {
        BreakerRegistryConfig {
            defaults,
            dependencies: overrides.into_iter().collect(),
        }
        .build()
    }

    /// The breaker of `dependency`, named after it.
    pub fn get(&self, dependency: &str) -> CircuitBreaker {
        let found = self
            .inner
            .breakers
            .read()
            .get(dependency)
            .and_then(|d| d.breaker.clone());
        if let Some(breaker) = found {
            return breaker;
        }
        let mut breakers = self.inner.breakers.write();
        let entry = breakers.entry(Name::from(dependency)).or_default();
        entry
            .breaker
            .get_or_insert_with(|| self.inner.make(dependency, None))
            .clone()
    }

    /// The breaker of one endpoint of `dependency`, named
    /// `"dependency/endpoint"`; separate from the dependency's own breaker.
    pub fn get_endpoint(&self, dependency: &str, endpoint: &str) -> CircuitBreaker {
        let found = self
            .inner
            .breakers
            .read()
            .get(dependency)
            .and_then(|d| d.endpoints.get(endpoint).cloned());
        if let Some(breaker) = found {
            return breaker;
        }
        let mut breakers = self.inner.breakers.write();
        let entry = breakers.entry(Name::from(dependency)).or_default();
        entry
            .endpoints
            .entry(Name::from(endpoint))
            .or_insert_with(|| self.inner.make(dependency, Some(endpoint)))
            .clone()
    }

    /// Every breaker made so far, sorted by dependency then endpoint.
    pub fn snapshot(&self) -> Vec<BreakerSnapshot> {
        let breakers = self.inner.breakers.read();
        let mut all = Vec::new();
        for (dependency, entry) in breakers.iter() {
            let view = |endpoint: Option<&Name>, breaker: &CircuitBreaker| BreakerSnapshot {
                dependency: dependency.to_string(),
                endpoint: endpoint.map(|e| e.to_string()),
                metrics: breaker.metrics(),
            };
            all.extend(entry.breaker.iter().map(|b| view(None, b)));
            all.extend(entry.endpoints.iter().map(|(e, b)| view(Some(e), b)));
        }
        all.sort_by(|a, b| (&a.dependency, &a.endpoint).cmp(&(&b.dependency, &b.endpoint)));
        all
    }
}

impl Registry {
    fn make(&self, dependency: &str, endpoint: Option<&str>) -> CircuitBreaker {
        let name = match endpoint {
            Some(endpoint) => format!("{dependency}/{endpoint}"),
            None => dependency.to_owned(),
        };
        let config = self
            .overrides
            .get(&name)
            .or_else(|| self.overrides.get(dependency))
            .unwrap_or(&self.defaults);
        CircuitBreaker::from_valid(config.clone(), name.into())
    }
}
