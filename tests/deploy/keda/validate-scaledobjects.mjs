// Reads a JSON array of KEDA ScaledObjects on stdin and validates each against
// KEDA's schema (@kubernetes-models/keda). Prints one line per object; exits 1
// if any is invalid. Used by tests/deploy/test_deploy_manifests.py.
import { readFileSync } from "node:fs";
import { ScaledObject } from "@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject";

const objects = JSON.parse(readFileSync(0, "utf8"));
let failed = 0;
for (const object of objects) {
  const name = object?.metadata?.name;
  try {
    new ScaledObject(object).validate();
    console.log(`valid ${name}`);
  } catch (error) {
    failed += 1;
    console.log(`invalid ${name}: ${error.message}`);
  }
}
process.exit(failed ? 1 : 0);
