//! A JSON Schema (2020-12) validator for the subset `docs/openapi.yaml` and
//! `docs/ws-frames.schema.json` use, and an OpenAPI 3.1 response checker on top of it.
//!
//! Supported keywords: `$ref` (local, `#/…` JSON pointers), `type` (one or a list), `enum`,
//! `const`, `properties`, `required`, `additionalProperties`, `propertyNames`,
//! `minProperties`, `maxProperties`, `items`, `minItems`, `maxItems`, `uniqueItems`,
//! `minimum`, `maximum`, `minLength`, `maxLength` (characters), `oneOf`, `anyOf`, `allOf`,
//! `not`; annotations (`description`, `title`, `default`, …) are skipped. Any other keyword
//! is a panic, not a silent pass: a document cannot use a keyword this checker ignores.
//! `integer` means a JSON number written without fraction or exponent (as serde_json reads
//! it), which is what the server writes.

#![allow(dead_code)]

use std::collections::BTreeSet;

use serde_json::{Map, Value};

/// Keywords that only annotate.
const ANNOTATIONS: &[&str] = &[
    "$schema",
    "$id",
    "$comment",
    "title",
    "description",
    "default",
    "examples",
    "deprecated",
    "readOnly",
    "writeOnly",
    "format",
];

/// The value at JSON pointer `ptr` (`#/a/b` or `/a/b`) in `doc`.
pub fn resolve<'a>(doc: &'a Value, ptr: &str) -> &'a Value {
    let ptr = ptr
        .strip_prefix('#')
        .unwrap_or_else(|| panic!("only local $refs: {ptr}"));
    doc.pointer(ptr)
        .unwrap_or_else(|| panic!("$ref {ptr} does not resolve"))
}

/// Errors of `instance` against `schema` (both within `doc`, for `$ref`s); empty when valid.
pub fn errors(doc: &Value, schema: &Value, instance: &Value) -> Vec<String> {
    let mut out = Vec::new();
    check(doc, schema, instance, "$", &mut out);
    out
}

/// Panics with the errors unless `instance` is valid against `schema`.
pub fn assert_valid(doc: &Value, schema: &Value, instance: &Value, what: &str) {
    let e = errors(doc, schema, instance);
    assert!(e.is_empty(), "{what}: {instance} is not valid: {e:#?}");
}

/// Panics unless `instance` is invalid against `schema`.
pub fn assert_invalid(doc: &Value, schema: &Value, instance: &Value, what: &str) {
    assert!(
        !errors(doc, schema, instance).is_empty(),
        "{what}: {instance} should not be valid"
    );
}

fn type_matches(ty: &str, v: &Value) -> bool {
    match ty {
        "null" => v.is_null(),
        "boolean" => v.is_boolean(),
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "number" => v.is_number(),
        "integer" => v.is_i64() || v.is_u64(),
        other => panic!("unknown type {other}"),
    }
}

fn num(v: &Value, kw: &str) -> f64 {
    v.as_f64()
        .unwrap_or_else(|| panic!("{kw} must be a number"))
}

fn count(v: &Value, kw: &str) -> usize {
    v.as_u64()
        .unwrap_or_else(|| panic!("{kw} must be a non-negative integer")) as usize
}

fn check(doc: &Value, schema: &Value, inst: &Value, at: &str, out: &mut Vec<String>) {
    let obj = match schema {
        Value::Bool(true) => return,
        Value::Bool(false) => {
            out.push(format!("{at}: no value is allowed"));
            return;
        }
        Value::Object(o) => o,
        other => panic!("a schema must be an object or a boolean: {other}"),
    };
    for (kw, arg) in obj {
        let err = |out: &mut Vec<String>, msg: String| out.push(format!("{at}: {msg}"));
        match kw.as_str() {
            k if ANNOTATIONS.contains(&k) => {}
            // handled with `properties`
            "additionalProperties" => {}
            "$ref" => {
                let target = resolve(doc, arg.as_str().expect("$ref is a string"));
                check(doc, target, inst, at, out);
            }
            "type" => {
                let ok = match arg {
                    Value::String(t) => type_matches(t, inst),
                    Value::Array(ts) => ts
                        .iter()
                        .any(|t| type_matches(t.as_str().expect("type name"), inst)),
                    other => panic!("bad type {other}"),
                };
                if !ok {
                    err(out, format!("type is not {arg}"));
                }
            }
            "enum" => {
                if !arg.as_array().expect("enum list").contains(inst) {
                    err(out, format!("not one of {arg}"));
                }
            }
            "const" => {
                if arg != inst {
                    err(out, format!("not {arg}"));
                }
            }
            "minimum" => {
                if inst.is_number() && inst.as_f64().unwrap() < num(arg, kw) {
                    err(out, format!("below {arg}"));
                }
            }
            "maximum" => {
                if inst.is_number() && inst.as_f64().unwrap() > num(arg, kw) {
                    err(out, format!("above {arg}"));
                }
            }
            "minLength" | "maxLength" => {
                if let Some(s) = inst.as_str() {
                    let n = s.chars().count();
                    let lim = count(arg, kw);
                    if (kw == "minLength" && n < lim) || (kw == "maxLength" && n > lim) {
                        err(out, format!("length {n} breaks {kw} {lim}"));
                    }
                }
            }
            "minItems" | "maxItems" => {
                if let Some(a) = inst.as_array() {
                    let lim = count(arg, kw);
                    if (kw == "minItems" && a.len() < lim) || (kw == "maxItems" && a.len() > lim) {
                        err(out, format!("{} items break {kw} {lim}", a.len()));
                    }
                }
            }
            "uniqueItems" => {
                if arg == &Value::Bool(true) {
                    if let Some(a) = inst.as_array() {
                        let distinct: BTreeSet<String> = a.iter().map(|v| v.to_string()).collect();
                        if distinct.len() != a.len() {
                            err(out, "items repeat".into());
                        }
                    }
                }
            }
            "items" => {
                if let Some(a) = inst.as_array() {
                    for (i, v) in a.iter().enumerate() {
                        check(doc, arg, v, &format!("{at}[{i}]"), out);
                    }
                }
            }
            "properties" => {
                if let Some(o) = inst.as_object() {
                    for (name, sub) in arg.as_object().expect("properties map") {
                        if let Some(v) = o.get(name) {
                            check(doc, sub, v, &format!("{at}.{name}"), out);
                        }
                    }
                }
            }
            "required" => {
                if let Some(o) = inst.as_object() {
                    for name in arg.as_array().expect("required list") {
                        let name = name.as_str().expect("required name");
                        if !o.contains_key(name) {
                            err(out, format!("missing {name}"));
                        }
                    }
                }
            }
            "propertyNames" => {
                if let Some(o) = inst.as_object() {
                    for name in o.keys() {
                        check(
                            doc,
                            arg,
                            &Value::String(name.clone()),
                            &format!("{at}.{name} (name)"),
                            out,
                        );
                    }
                }
            }
            "minProperties" | "maxProperties" => {
                if let Some(o) = inst.as_object() {
                    let lim = count(arg, kw);
                    if (kw == "minProperties" && o.len() < lim)
                        || (kw == "maxProperties" && o.len() > lim)
                    {
                        err(out, format!("{} properties break {kw} {lim}", o.len()));
                    }
                }
            }
            "allOf" => {
                for sub in arg.as_array().expect("allOf list") {
                    check(doc, sub, inst, at, out);
                }
            }
            "anyOf" | "oneOf" => {
                let subs = arg.as_array().expect("list");
                let matching = subs
                    .iter()
                    .filter(|sub| errors(doc, sub, inst).is_empty())
                    .count();
                if matching == 0 || (kw == "oneOf" && matching > 1) {
                    let detail: Vec<Vec<String>> =
                        subs.iter().map(|sub| errors(doc, sub, inst)).collect();
                    err(out, format!("{matching} of {kw} match: {detail:?}"));
                }
            }
            "not" => {
                if errors(doc, arg, inst).is_empty() {
                    err(out, "matches `not`".into());
                }
            }
            other => panic!("unsupported JSON Schema keyword {other:?} (at {at})"),
        }
    }
    if let (Some(o), Some(extra)) = (inst.as_object(), obj.get("additionalProperties")) {
        let empty = Map::new();
        let known = obj
            .get("properties")
            .and_then(Value::as_object)
            .unwrap_or(&empty);
        for (name, v) in o {
            if !known.contains_key(name) {
                match extra {
                    Value::Bool(false) => out.push(format!("{at}: unexpected property {name}")),
                    sub => check(doc, sub, v, &format!("{at}.{name}"), out),
                }
            }
        }
    }
}

/// An OpenAPI 3.1 document and the (method, path, status) triples the test has seen.
pub struct OpenApi {
    pub doc: Value,
    pub seen: BTreeSet<(String, String, String)>,
}

impl OpenApi {
    /// Parses the YAML text.
    pub fn parse(yaml: &str) -> OpenApi {
        let doc: Value = serde_yaml::from_str(yaml).expect("openapi.yaml parses");
        assert_eq!(doc["openapi"], "3.1.0");
        OpenApi {
            doc,
            seen: BTreeSet::new(),
        }
    }

    /// `x` itself, or what its `$ref` points to.
    fn deref<'a>(&'a self, x: &'a Value) -> &'a Value {
        match x.get("$ref").and_then(Value::as_str) {
            Some(r) => resolve(&self.doc, r),
            None => x,
        }
    }

    /// Every documented (method, path, status).
    pub fn documented(&self) -> BTreeSet<(String, String, String)> {
        let mut out = BTreeSet::new();
        for (path, item) in self.doc["paths"].as_object().unwrap() {
            for (method, op) in item.as_object().unwrap() {
                for status in op["responses"].as_object().unwrap().keys() {
                    out.insert((method.to_uppercase(), path.clone(), status.clone()));
                }
            }
        }
        out
    }

    /// The response object of (method, path template, status); panics when not documented.
    pub fn response(&self, method: &str, path: &str, status: u16) -> &Value {
        let op = &self.doc["paths"][path][method.to_lowercase()];
        assert!(op.is_object(), "{method} {path} is not documented");
        let r = &op["responses"][status.to_string()];
        assert!(
            r.is_object(),
            "{method} {path} answered {status}, which the document does not list"
        );
        self.deref(r)
    }

    /// Checks a real response: `status` is documented for (method, `path` template); the
    /// content type is one of the documented media types; a JSON body validates against the
    /// documented schema. Records the triple as seen.
    pub fn check(
        &mut self,
        method: &str,
        path: &str,
        status: u16,
        content_type: Option<&str>,
        body: &str,
    ) {
        let r = self.response(method, path, status).clone();
        self.seen
            .insert((method.to_uppercase(), path.to_string(), status.to_string()));
        let Some(content) = r.get("content").and_then(Value::as_object) else {
            return;
        };
        let ct = content_type
            .unwrap_or_else(|| panic!("{method} {path} {status}: no content type"))
            .split(';')
            .next()
            .unwrap()
            .trim()
            .to_ascii_lowercase();
        let media = content.get(&ct).unwrap_or_else(|| {
            panic!(
                "{method} {path} {status}: content type {ct} is not documented ({:?})",
                content.keys().collect::<Vec<_>>()
            )
        });
        let schema = &media["schema"];
        if ct == "application/json" || ct.ends_with("+json") {
            let v: Value = serde_json::from_str(body)
                .unwrap_or_else(|e| panic!("{method} {path} {status}: not JSON ({e}): {body}"));
            assert_valid(&self.doc, schema, &v, &format!("{method} {path} {status}"));
        } else {
            assert_valid(
                &self.doc,
                schema,
                &Value::String(body.to_string()),
                &format!("{method} {path} {status}"),
            );
        }
    }

    /// The schema of a JSON response (method, path template, status).
    pub fn json_schema(&self, method: &str, path: &str, status: u16) -> Value {
        self.response(method, path, status)["content"]["application/json"]["schema"].clone()
    }
}
