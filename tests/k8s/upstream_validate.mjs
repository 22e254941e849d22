// Validates Gateway API, cert-manager and Prometheus Operator objects against the upstream schemas that the
// npm packages pinned in package.json ship (installed by `make setup` into node_modules/; see package.json and
// tests/k8s/test_gateway.py). One process checks every object it is given:
//
//   stdin:  a JSON array of Kubernetes objects
//   stdout: {"packages": {name: version}, "errors": [[message, ...] for each object, in order]}
//
// Two checks per object, both from the same generated package:
//  1. values: the package's compiled JSON-schema validator (the class's validate(), ajv): types, enums,
//     patterns, min/max, required fields, apiVersion and kind;
//  2. field names: the package's TypeScript declarations, through TypeScript's excess-property check on the
//     object as a literal of the kind's interface. The validators, like the CRD schemas they come from, accept
//     unknown fields (the API server prunes them, or rejects them under strict field validation, kubectl's
//     default); the declarations list exactly the schema's properties, so a misspelled field fails here.
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";
import { fileURLToPath } from "node:url";

const require = createRequire(import.meta.url);
const HERE = path.dirname(fileURLToPath(import.meta.url));

// apiVersion -> [package, module directory inside it, kinds]
const GROUPS = {
  "gateway.networking.k8s.io/v1": ["@kubernetes-models/gateway-api", "gateway.networking.k8s.io/v1",
                                   ["Gateway", "HTTPRoute", "GRPCRoute"]],
  "cert-manager.io/v1": ["@kubernetes-models/cert-manager", "cert-manager.io/v1", ["Certificate"]],
  "monitoring.coreos.com/v1": ["@kubernetes-models/prometheus-operator", "monitoring.coreos.com/v1",
                               ["PodMonitor", "PrometheusRule"]],
};

function modelOf(doc) {
  const group = GROUPS[doc?.apiVersion];
  if (!group || !group[2].includes(doc.kind)) return null;
  return { pkg: group[0], module: `${group[0]}/${group[1]}/${doc.kind}`, kind: doc.kind };
}

const docs = JSON.parse(readFileSync(0, "utf8"));
const errors = docs.map(() => []);
const models = docs.map(modelOf);

// 1. the compiled validators
for (const [i, doc] of docs.entries()) {
  const m = models[i];
  if (!m) {
    const known = Object.entries(GROUPS).flatMap(([api, g]) => g[2].map((k) => `${api} ${k}`));
    errors[i].push(`<root>: no upstream schema for apiVersion ${doc?.apiVersion} kind ${doc?.kind} `
                   + `(known: ${known.join(", ")})`);
    continue;
  }
  const cls = (await import(m.module))[m.kind];
  try {
    new cls(doc).validate();
  } catch (e) {
    if (!e.errors) throw e;
    for (const err of e.errors) {
      const where = err.instancePath.replace(/^\//, "").replaceAll("/", ".") || "<root>";
      errors[i].push(`${where}: ${err.message}${err.params?.allowedValues
        ? ` (${err.params.allowedValues.join(", ")})` : ""} [schema]`);
    }
  }
}

// 2. the declarations: one virtual module, one line per object, so a diagnostic's line says whose it is
const ts = require("typescript");
const lines = [];
const lineOf = [];
for (const [i, doc] of docs.entries()) {
  if (!models[i]) continue;
  lines.push(`import type { I${models[i].kind} as T${i} } from "${models[i].module}";`);
}
const first = lines.length;
for (const [i, doc] of docs.entries()) {
  if (!models[i]) continue;
  lineOf[lines.length] = i;
  lines.push(`export const d${i}: T${i} = ${JSON.stringify(doc)};`);
}
const file = path.join(HERE, "__upstream_manifests__.mts");
const text = lines.join("\n") + "\n";
const options = {
  strict: true, noEmit: true, skipLibCheck: true, types: [], lib: ["lib.es2022.d.ts"],
  target: ts.ScriptTarget.ES2022, module: ts.ModuleKind.NodeNext, moduleResolution: ts.ModuleResolutionKind.NodeNext,
};
const host = ts.createCompilerHost(options);
const { getSourceFile, fileExists, readFile } = host;
host.getSourceFile = (name, lang, ...rest) =>
  name === file ? ts.createSourceFile(name, text, lang, true) : getSourceFile.call(host, name, lang, ...rest);
host.fileExists = (name) => name === file || fileExists.call(host, name);
host.readFile = (name) => (name === file ? text : readFile.call(host, name));
// the object path (spec.rules.0.timeout) of the literal at a diagnostic's position
function pathAt(source, pos) {
  let node = source;
  for (let next = node; next;) {
    node = next;
    next = node.getChildren(source).find((c) => c.getStart(source) <= pos && pos < c.getEnd());
  }
  const parts = [];
  for (; node && !ts.isVariableDeclaration(node); node = node.parent) {
    if (ts.isPropertyAssignment(node)) parts.unshift(node.name.text);
    else if (node.parent && ts.isArrayLiteralExpression(node.parent)) parts.unshift(node.parent.elements.indexOf(node));
  }
  return parts.join(".") || "<root>";
}
const program = ts.createProgram([file], options, host);
for (const d of ts.getPreEmitDiagnostics(program)) {
  const message = ts.flattenDiagnosticMessageText(d.messageText, " ");
  if (d.file?.fileName !== file) throw new Error(`TypeScript: ${message}`);
  const { line } = d.file.getLineAndCharacterOfPosition(d.start);
  if (line < first) throw new Error(`TypeScript, importing the declarations: ${message}`);
  errors[lineOf[line]].push(`${pathAt(d.file, d.start)}: ${message} [declarations]`);
}

const packages = {};
for (const name of [...new Set(Object.values(GROUPS).map((g) => g[0])), "typescript"]) {
  packages[name] = require(`${name}/package.json`).version;
}
process.stdout.write(JSON.stringify({ packages, errors }));
