// A client of readie.v1.Worker in Node (@grpc/grpc-js), as a client developer
// outside Python would write one: TLS against the server's CA, a bearer token,
// keepalive, readie's metadata on a refusal. Prints one JSON line per check.
//
//   node client.mjs ADDRESS PROTO_DIR CA_PEM TOKEN
import { readFileSync } from "node:fs";
import grpc from "@grpc/grpc-js";
import protoLoader from "@grpc/proto-loader";

const [address, protoDir, caPath, token] = process.argv.slice(2);
const definition = protoLoader.loadSync("readie/v1/worker.proto", {
  includeDirs: [protoDir],
  keepCase: true,
  longs: Number,
  defaults: false,
  oneofs: true,
});
const { Worker } = grpc.loadPackageDefinition(definition).readie.v1;
const options = { "grpc.keepalive_time_ms": 10000, "grpc.keepalive_permit_without_calls": 1 };
const tls = grpc.credentials.createSsl(readFileSync(caPath));
const bearer = grpc.credentials.createFromMetadataGenerator((_, callback) => {
  const metadata = new grpc.Metadata();
  metadata.set("authorization", `Bearer ${token}`);
  callback(null, metadata);
});
const client = new Worker(address, grpc.credentials.combineChannelCredentials(tls, bearer), options);
const anonymous = new Worker(address, tls, options);

function call(stub, method, request) {
  return new Promise((resolve) => {
    stub[method](request, { deadline: Date.now() + 30000 }, (error, response) => resolve({ error, response }));
  });
}

function refusal(error) {
  const trailers = error.metadata.getMap();
  return { code: grpc.status[error.code], error: trailers["readie-error"], field: trailers["readie-field"] };
}

const checks = {};
const capacity = await call(client, "Capacity", {});
checks.capacity = capacity.error ? refusal(capacity.error) : { slots: capacity.response.slots };
const ran = await call(client, "RunJob", { checkpoint: "base", code: "print(6 * 7)", timeout_ms: 20000 });
checks.run = ran.error ? refusal(ran.error) : { exit: ran.response.exit, stdout: ran.response.stdout };
const refused = await call(client, "RunJob", { checkpoint: "base", code: "pass", allow_read: ["/etc"] });
checks.refused = refused.error ? refusal(refused.error) : { unexpected: "success" };
const unauthenticated = await call(anonymous, "Capacity", {});
checks.unauthenticated = unauthenticated.error ? refusal(unauthenticated.error) : { unexpected: "success" };
console.log(JSON.stringify(checks));
client.close();
anonymous.close();
