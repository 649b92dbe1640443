//! proxy-wasm glue: read the request, ask the pure classifier, write the decision back.
//!
//! The request path must never panic (a panic aborts the VM and fails every request on the
//! worker), so every host call result is handled and the fallback is always "leave the
//! request alone and let the default route take it".

use crate::classify::{classify, RequestView};
use crate::config::{FilterConfig, HEADER_CLASS, HEADER_POOL, HEADER_RULE, INTERNAL_HEADER_PREFIX};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};
use std::rc::Rc;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root { config: None }) });
}}

struct Root {
    /// The last configuration that validated. A rejected update leaves it in place.
    config: Option<Rc<FilterConfig>>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = self.get_plugin_configuration().unwrap_or_default();
        match FilterConfig::parse(&bytes) {
            Ok(cfg) => {
                log::info!(
                    "infermesh: config accepted: {} rules, default class {}",
                    cfg.rules.len(),
                    cfg.default_class
                );
                self.config = Some(Rc::new(cfg));
                true
            }
            Err(e) => {
                // Returning false makes Envoy refuse this configuration; a previously
                // accepted one (self.config) keeps serving.
                log::error!("infermesh: {e}; keeping the last good config");
                false
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Request { config: self.config.clone() }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Request {
    config: Option<Rc<FilterConfig>>,
}

/// A snapshot of the request headers taken once, so the classifier sees a consistent view and
/// each header is fetched from the host a single time.
struct Headers {
    all: Vec<(String, String)>,
}

impl Headers {
    fn get(&self, name: &str) -> Option<&str> {
        self.all.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

impl RequestView for Headers {
    fn method(&self) -> Option<&str> {
        self.get(":method")
    }
    fn path(&self) -> Option<&str> {
        self.get(":path")
    }
    fn header(&self, name: &str) -> Option<&str> {
        self.get(name)
    }
}

impl Context for Request {}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let headers = Headers { all: self.get_http_request_headers() };
        // Never trust a client's own routing headers: drop every internal header first.
        for (name, _) in headers.all.iter().filter(|(k, _)| k.starts_with(INTERNAL_HEADER_PREFIX)) {
            self.set_http_request_header(name, None);
        }
        let config = match &self.config {
            Some(c) => Rc::clone(c),
            None => return Action::Continue,
        };
        let d = classify(&config, &headers);
        self.set_http_request_header(HEADER_CLASS, Some(d.class));
        self.set_http_request_header(HEADER_POOL, Some(d.pool));
        self.set_http_request_header(HEADER_RULE, Some(d.rule));
        Action::Continue
    }
}
