// Reads a JSON array of KEDA ScaledObjects on stdin and validates each against
// KEDA's schema (@kubernetes-models/keda), strictly: a field that KEDA's types
// do not have fails, as it does on an API server (kubectl's field validation
// is Strict by default since Kubernetes 1.27). Prints one line per object,
// "valid NAME" or "invalid NAME: MESSAGE"; exits 1 if any is invalid. Used by
// tests/deploy/test_deploy_manifests.py.
//
// Strictness: the schema compiled into the package has no
// `additionalProperties: false`, so on its own it lets "minReplicaCont" or
// "bogus" through. Its validator reads every property its schema declares on
// an object it checks, and enumerates the keys of a map (labels, a trigger's
// metadata). So the object is handed to it behind proxies that record what it
// reads: a key of a checked object that it never read is a field the schema
// does not know. An object none of whose keys it read, and which it never
// enumerated, is free-form (a schema without properties) and is not judged.
import { readFileSync } from "node:fs";
import { ScaledObject } from "@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject";

/** Wraps `value` (and, lazily, what is read from it) in recording proxies.
 * `reads` maps each plain object to {path, keys read, enumerated}. */
function watch(value, path, reads) {
  if (value === null || typeof value !== "object") return value;
  const isArray = Array.isArray(value);
  const record = { path, read: new Set(), enumerated: false };
  if (!isArray) reads.set(value, record);
  return new Proxy(value, {
    get(target, key, receiver) {
      const child = Reflect.get(target, key, receiver);
      if (typeof key !== "string") return child;
      record.read.add(key); // absent keys too: a declared field is read either way
      return Object.hasOwn(target, key) ? watch(child, `${path}/${key}`, reads) : child;
    },
    has(target, key) {
      if (typeof key === "string") record.read.add(key);
      return Reflect.has(target, key);
    },
    ownKeys(target) {
      record.enumerated = true;
      return Reflect.ownKeys(target);
    },
  });
}

/** The fields of `object` that the validator never looked at, as
 * "data/path has unknown field NAME" strings, in document order. */
function unknownFields(reads) {
  const found = [];
  for (const [target, { path, read, enumerated }] of reads) {
    if (enumerated || read.size === 0) continue;
    for (const key of Object.keys(target)) {
      if (!read.has(key)) found.push(`${path} has unknown field ${key}`);
    }
  }
  return found;
}

/** Throws an Error naming every schema error and every unknown field. */
function validateStrictly(object) {
  const reads = new Map();
  const problems = [];
  try {
    // Called on the proxy itself: the model's constructor would copy (and so
    // read) every key before the validator saw them.
    ScaledObject.prototype.validate.call(watch(object, "data", reads));
  } catch (error) {
    problems.push(error.message);
  }
  problems.push(...unknownFields(reads));
  if (problems.length) throw new Error(problems.join(", "));
}

const objects = JSON.parse(readFileSync(0, "utf8"));
let failed = 0;
for (const object of objects) {
  const name = object?.metadata?.name;
  try {
    validateStrictly(object);
    console.log(`valid ${name}`);
  } catch (error) {
    failed += 1;
    console.log(`invalid ${name}: ${error.message}`);
  }
}
process.exit(failed ? 1 : 0);
